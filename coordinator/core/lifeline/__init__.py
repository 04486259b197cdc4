"""No process outlives the process that started it (DESIGN §9), on Linux.

- :func:`spawn` starts a child that the kernel kills when this process dies, however it
  dies (SIGKILL included): a parent-death signal armed by a tiny exec trampoline, forked
  from one thread that lives as long as the process. The agent's workers and every etcd
  started by :mod:`coordinator.etcd_server` are started this way.
- :class:`Janitor` removes directories once this process and the children it watches are
  gone: the embedded etcd's data directory goes even when the agent is SIGKILLed.

Each module's docstring says why it is built the way it is, and what happens elsewhere
than on Linux. Standard library only, no torch: the core, the etcd process manager and
the agent all use it.
"""

from coordinator.core.lifeline.janitor import JANITOR_SUPPORTED, Janitor
from coordinator.core.lifeline.spawn import PDEATHSIG_SUPPORTED, Spawned, spawn

__all__ = ["JANITOR_SUPPORTED", "PDEATHSIG_SUPPORTED", "Janitor", "Spawned", "spawn"]

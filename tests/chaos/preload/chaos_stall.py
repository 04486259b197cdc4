"""Imported ahead by every warm interpreter of a chaos run (``--warm-modules
torch,chaos_stall``; this folder is on the agents' PYTHONPATH), it hangs one import on
purpose for the ``warm_import_stuck`` fault: the harness creates
``$CHAOS_STALL_DIR/stall-<agent pid>``, and the first warm interpreter of that agent to
get here takes the file and blocks for good, using no CPU, as an import stuck on a lock
or a network file system does. Every other import returns at once. Not a package of the
project: only the standard library."""

import os
import threading

_DIR = os.environ.get("CHAOS_STALL_DIR", "")
if _DIR:
    _ARM = os.path.join(_DIR, f"stall-{os.getppid()}")
    try:
        os.rename(_ARM, _ARM + ".taken")
    except OSError:
        pass
    else:
        with open(_ARM + ".taken", "w") as _taken:
            _taken.write(str(os.getpid()))  # the harness tells the stuck one from the others
        threading.Event().wait()

"""The command line of ``etcdrun``: parse and check every flag (torchrun's names and
values, and the ``PET_*`` variables that set them), count the devices of
``--nproc-per-node``, start the embedded etcd of ``--standalone``, then hand a validated
:class:`agent.config.LaunchConfig` to :func:`agent.cli.launcher.launch`, which builds the
rendezvous handler, the metrics endpoint and the stop requests, and runs the loop.
Every bad value ends here with one ``etcdrun: error:`` line naming the flag."""

from agent.cli.etcdrun import main

__all__ = ["main"]

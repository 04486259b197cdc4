"""What a training script may import from etcd-elastic: the stable, public surface.

    from etcd_elastic import report_progress, pause_progress

* :func:`report_progress` — call after each training step; with ``etcdrun
  --hang-timeout`` a node whose workers stop reporting is declared hung and the run
  re-forms, naming the node that stopped first. Without the agent it does nothing.
* :func:`pause_progress` — call before a long phase that reports nothing (a last
  checkpoint, an evaluation), so it is not taken for a hang.

This package imports only the standard library, so a worker pays nothing for it, and
its name is the project's own: a training script's own ``agent`` module cannot shadow it.
``tests/unit/test_public_api.py`` pins this surface; anything not listed in ``__all__``
may change without notice.
"""

from etcd_elastic.progress import pause_progress, report_progress

__all__ = ["pause_progress", "report_progress"]

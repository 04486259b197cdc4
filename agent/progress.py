"""Kept for training scripts written against earlier releases: use :mod:`etcd_elastic`.

``from agent.progress import report_progress`` still works, but a script's own ``agent``
module or package (common in reinforcement-learning and LLM-agent code) shadows this one;
``from etcd_elastic import report_progress`` cannot collide.
"""

from etcd_elastic.progress import pause_progress, report_progress

__all__ = ["pause_progress", "report_progress"]

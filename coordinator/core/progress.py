"""Training progress of the nodes of a run, and who stopped first when they hang.

Each agent publishes its workers' last progress (:class:`NodeProgress`) at
``<prefix>/<run>/progress/<node_id>``, bound to its lease, so ``rdzvctl status`` shows
every node's last step and its age and a node that declares a hang can tell who stopped
first (:func:`who_stopped_first`). The key is apart from ``nodes/`` on purpose: the
coordinator watches ``nodes/``, and progress must not wake it.

Everything here is pure except nothing: the codec and the rule. The agent side (reading
the workers' progress file, publishing, declaring) is ``agent/health/hang.py``; the rule and its
limits are explained in ``docs/hang-detection.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.core.errors import CorruptValueError
from coordinator.core.state import SCHEMA_VERSION, _parse, _to_json
from coordinator.generated import rendezvous_pb2 as pb

__all__ = ["Blame", "NodeProgress", "decode_progress", "encode_progress", "who_stopped_first"]


@dataclass(frozen=True)
class NodeProgress:
    """One node's last reported progress (the ``progress/<node_id>`` value).

    Attributes:
        node_id: the node.
        round: the round whose workers reported.
        step: the lowest step over the node's local workers that reported.
        age_ms: milliseconds since that step was reported, when this value was written.
        reported_at_unix_ms: the node's wall clock at that report (informational).
        workers_reporting: local workers that reported in ``round``.
        local_world_size: the node's workers.
        stalled: no progress for ``hang_timeout_ms``.
        hang_timeout_ms: the node's ``--hang-timeout`` (0: detection off).
    """

    node_id: str
    round: int
    step: int
    age_ms: int = 0
    reported_at_unix_ms: int = 0
    workers_reporting: int = 0
    local_world_size: int = 0
    stalled: bool = False
    hang_timeout_ms: int = 0


def encode_progress(progress: NodeProgress) -> bytes:
    msg = pb.NodeProgress(
        schema_version=SCHEMA_VERSION,
        node_id=progress.node_id,
        round=progress.round,
        step=progress.step,
        age_ms=progress.age_ms,
        reported_at_unix_ms=progress.reported_at_unix_ms,
        workers_reporting=progress.workers_reporting,
        local_world_size=progress.local_world_size,
        stalled=progress.stalled,
        hang_timeout_ms=progress.hang_timeout_ms,
    )
    return _to_json(msg)


def decode_progress(key: str, raw: bytes) -> NodeProgress:
    """Decode a progress key's value; raises CorruptValueError naming ``key``."""
    msg = pb.NodeProgress()
    _parse(key, raw, msg)
    if msg.round < 0 or msg.age_ms < 0 or msg.workers_reporting < 0:
        raise CorruptValueError(key, "negative round, age_ms or workers_reporting")
    return NodeProgress(
        node_id=msg.node_id,
        round=msg.round,
        step=msg.step,
        age_ms=msg.age_ms,
        reported_at_unix_ms=msg.reported_at_unix_ms,
        workers_reporting=msg.workers_reporting,
        local_world_size=msg.local_world_size,
        stalled=msg.stalled,
        hang_timeout_ms=msg.hang_timeout_ms,
    )


@dataclass(frozen=True)
class Blame:
    """Who :func:`who_stopped_first` names.

    Attributes:
        nodes: the node(s) that stopped first, sorted.
        step: the step they reported last.
        behind: True when they are at a lower step than another reporting node; False
            when every reporting node is at that step (a tie that progress cannot break:
            ``nodes`` is then the declaring node, the first to reach the timeout).
    """

    nodes: tuple[str, ...]
    step: int
    behind: bool


def who_stopped_first(
    declarer: str, own_step: int, records: Mapping[str, NodeProgress], round: int
) -> Blame:
    """Name the node(s) that stopped first in ``round`` (pure).

    The rule, for a synchronous job (every step ends in a collective, as with DDP or
    FSDP): a node cannot finish step ``k + 1`` before every other node finished step
    ``k``, so when the job stops, a node at a lower step than the others is the one that
    stopped first, and the others wait for it. So: the nodes at the **lowest step** among
    the round's progress records; if every reporting node is at that same step, progress
    cannot tell them apart, and the **declaring node** is named, being the one whose own
    workers' last report was the oldest when it reached the timeout (each node measures
    that on its own monotonic clock; clocks of two machines are never compared).

    Args:
        declarer: the node declaring the hang (its own workers made no progress for the
            timeout).
        own_step: the declarer's step, from its workers directly (fresher than its record).
        records: progress records by node id, as read from etcd; records of another
            round are ignored.
        round: the round the hang is declared in.
    """
    steps = {node: p.step for node, p in records.items() if p.round == round}
    steps[declarer] = own_step
    lowest = min(steps.values())
    at_lowest = tuple(sorted(node for node, step in steps.items() if step == lowest))
    if len(at_lowest) < len(steps):
        return Blame(at_lowest, lowest, behind=True)
    return Blame((declarer,), lowest, behind=False)

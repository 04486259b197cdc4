"""Training progress of the nodes of a run, and who stopped first when they hang.

An agent writes its workers' last progress (:class:`NodeProgress`) at
``<prefix>/<run>/progress/<node_id>``, bound to its lease, only while it **suspects** a
hang (its workers made no progress for most of ``--hang-timeout``), and deletes it when
they make progress again: a healthy node writes nothing. So ``rdzvctl status`` shows the
stalled nodes and their steps, and a node that declares a hang reads every suspicion
with one range read to tell who stopped first (:func:`who_stopped_first`). The key is
apart from ``nodes/`` on purpose: the coordinator watches ``nodes/``, and progress must
not wake it.

Everything here is pure: the codec and the rule. The agent side (reading the workers'
progress file, suspecting, declaring) is ``agent/health/hang.py``; the rule and its
limits are explained in ``docs/hang-detection.md``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from coordinator.core.errors import CorruptValueError
from coordinator.core.state import SCHEMA_VERSION, _parse, _to_json
from coordinator.generated import rendezvous_pb2 as pb

__all__ = ["Blame", "NodeProgress", "decode_progress", "encode_progress", "who_stopped_first"]


@dataclass(frozen=True)
class NodeProgress:
    """One node's progress when it suspected a hang (the ``progress/<node_id>`` value).

    Attributes:
        node_id: the node.
        round: the round whose workers stalled.
        step: the lowest step over the node's local workers that reported.
        age_ms: milliseconds since that step was reported, when this value was written
            (the node's silence when it began to suspect).
        reported_at_unix_ms: the node's wall clock at that report (informational).
        workers_reporting: local workers that reported in ``round``.
        local_world_size: the node's workers.
        stalled: the node suspects a hang; always true in what an agent writes now (an
            agent of an earlier version also wrote records of healthy nodes, with false:
            those are no suspicion).
        hang_timeout_ms: the node's ``--hang-timeout``.
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
        behind: True when they stopped while others went on: at a lower step than another
            stalled node, or stalled while some node of the round was not; False when
            every node of the round is stalled at that step (a tie that progress cannot
            break: ``nodes`` is then the declaring node, the first to reach the timeout).
    """

    nodes: tuple[str, ...]
    step: int
    behind: bool


def who_stopped_first(
    declarer: str,
    own_step: int,
    records: Mapping[str, NodeProgress],
    round: int,
    participants: Collection[str] = (),
) -> Blame:
    """Name the node(s) that stopped first in ``round`` (pure).

    ``records`` are the round's suspicions: a node writes its record only once its own
    workers made no progress for most of the timeout (each node measures that on its own
    monotonic clock; clocks of two machines are never compared), and deletes it when it
    makes progress again. A node of the round without a record was therefore not stalled
    (or its script does not report).

    The rule, for a synchronous job (every step ends in a collective, as with DDP or
    FSDP): a node cannot finish step ``k + 1`` before every other node finished step
    ``k``, so when the job stops, a node at a lower step than the others is the one that
    stopped first, and the others wait for it. So: the stalled nodes at the **lowest
    step**, when another stalled node is at a higher step or some node of the round is
    not stalled; if every node of the round is stalled at that same step, progress
    cannot tell them apart, and the **declaring node** is named, being the one whose own
    workers' last report was the oldest when it reached the timeout.

    Args:
        declarer: the node declaring the hang (its own workers made no progress for the
            timeout).
        own_step: the declarer's step, from its workers directly.
        records: progress records by node id, as read from etcd; records of another
            round, or not ``stalled``, are ignored.
        round: the round the hang is declared in.
        participants: the nodes of ``round`` (empty: unknown, then every node is taken
            as stalled).
    """
    steps = {node: p.step for node, p in records.items() if p.round == round and p.stalled}
    steps[declarer] = own_step
    lowest = min(steps.values())
    at_lowest = tuple(sorted(node for node, step in steps.items() if step == lowest))
    not_stalled = set(participants) - steps.keys()
    if len(at_lowest) < len(steps) or not_stalled:
        return Blame(at_lowest, lowest, behind=True)
    return Blame((declarer,), lowest, behind=False)

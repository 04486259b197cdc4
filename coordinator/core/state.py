"""The rendezvous state and node records as plain values, and their stored form.

``RdzvState`` is what the state key holds; ``NodeInfo`` is what a node key holds. Both are
frozen: the pure functions in :mod:`coordinator.core.actions` return new values. The stored
form is the protobuf schema in ``proto/rendezvous.proto`` written with protobuf's JSON
mapping, so ``etcdctl get`` shows it readably. Decoding never executes anything: a value
that is not valid JSON of our schema, or has a newer ``schema_version``, raises
:class:`~coordinator.core.errors.CorruptValueError` naming the key.

Decoding also refuses values that parse but that no agent could carry on from: a round
whose next round would not fit the schema's int64 (``round > MAX_ROUND``; otherwise the
protobuf encoder fails with a bare ``ValueError: Value out of range`` on every agent at
once when the next round is written), a negative ``wanted_round``, and a port outside
0..65535 (it would reach the workers as ``MASTER_PORT``). Whatever decodes re-encodes, and
so do the node records and the state of the round after it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Literal

from google.protobuf import json_format
from google.protobuf.message import Message

from coordinator.core.errors import CorruptValueError
from coordinator.core.restart_budget import RestartCount, count_message, count_of_message
from coordinator.core.worker_kinds import put_workers, read_workers
from coordinator.generated import rendezvous_pb2 as pb

__all__ = [
    "CLOSE_MODE_CODES",
    "MAX_ROUND",
    "SCHEMA_VERSION",
    "CloseMode",
    "Hang",
    "NodeInfo",
    "Quarantine",
    "RdzvState",
    "close_mode_of",
    "decode_node",
    "decode_state",
    "encode_node",
    "encode_state",
]

SCHEMA_VERSION = 4
"""2 added ``incarnation`` to the state and the node records; a value of version 1 has none
and decodes as incarnation 1 (a reader of version 1 refuses version 2 with "upgrade every
agent of the run"). 3 added what each participant runs (``worker_kinds``,
``worker_kind_of``) to the state; a value of version 2 has none (the agents then agree on
ranks through the round's store). 4 added the job's restart count (``restarts``): an
older agent must not join such a run (counting per node, a node that leaves and joins
again would bypass the job's budget), so it refuses it with "upgrade every agent"."""

MAX_ROUND = 2**63 - 2
"""The highest round a state may hold: nodes ask for ``round + 1`` and a completion writes
it, so ``round + 1`` must still fit the schema's int64. Above it, decoding refuses."""
_MAX_PORT = 65535

CloseMode = Literal["unspecified", "finished", "failed", "drain"]
"""Why a run was closed: ``finished`` (every agent done), ``failed`` (an agent gave up: the
others stop and exit non-zero), ``drain`` (an operator ended it: agents finish their
current attempt, then exit 0)."""

CLOSE_MODE_CODES: dict[CloseMode, int] = {
    "unspecified": pb.CLOSE_MODE_UNSPECIFIED,
    "finished": pb.CLOSE_MODE_FINISHED,
    "failed": pb.CLOSE_MODE_FAILED,
    "drain": pb.CLOSE_MODE_DRAIN,
}
"""Each close mode's protobuf enum value: the one table, for the state and the events."""
_CLOSE_MODE_NAMES: dict[int, CloseMode] = {code: mode for mode, code in CLOSE_MODE_CODES.items()}


def close_mode_of(code: int) -> CloseMode:
    """The close mode of a protobuf enum value (an unknown, newer value: unspecified)."""
    return _CLOSE_MODE_NAMES.get(code, "unspecified")


@dataclass(frozen=True)
class Hang:
    """A hang declared in a round (``--hang-timeout``): see ``docs/hang-detection.md``.

    Attributes:
        round: the round whose workers hung; every participant of it restarts (counted).
        nodes: the node(s) that stopped first.
        step: the step those nodes reported last.
        behind: True when ``nodes`` are at a lower step than the other reporting nodes;
            False when every reporting node stopped at the same step (``nodes`` is then
            the node that reached the timeout first).
        declared_by: the node that declared it.
        stalled_ms: how long the declaring node's workers had made no progress.
        declared_at_unix_ms: the declaring node's wall clock (informational).
    """

    round: int
    nodes: tuple[str, ...]
    step: int
    behind: bool = False
    declared_by: str = ""
    stalled_ms: int = 0
    declared_at_unix_ms: int = 0


@dataclass(frozen=True)
class Quarantine:
    """A node left out of the rounds until ``until_unix_ms`` (``etcdrun --health-check``).

    Attributes:
        node_id: the node.
        reason: why, in one line.
        until_unix_ms: when it may be admitted again: the writer's wall clock plus the
            quarantine's length, judged by the coordinator's wall clock only.
        addr: the node's address, for operators.
    """

    node_id: str
    reason: str
    until_unix_ms: int
    addr: str = ""


@dataclass(frozen=True)
class RdzvState:
    """The agreed state of one run.

    Attributes:
        round: the last completed round (0: the first is still forming). Nodes that
            want in ask for ``round + 1``.
        closed: the run is over; joins fail with ``RendezvousClosedError``.
        participants: node ids of ``round``; the index is the group rank.
        wait_list: live nodes asking for ``round + 1`` (a reason for participants to
            re-rendezvous).
        redundancy_list: live nodes asking for ``round + 1`` while ``round`` is full.
        lost: participants of ``round`` whose lease ended (survivors must re-rendezvous).
        master_addr, master_port: bootstrap address of ``round`` (rank 0's).
        incarnation: which start of the run this is (1, 2, ...): a closed run whose every
            node has left is started again as ``incarnation + 1``.
        draining: nodes an operator asked to leave (``rdzvctl drain``).
        hang: the last hang declared (None: none); it concerns ``hang.round`` only.
        quarantined: nodes left out of the rounds for a while (failed or slow in the
            pre-flight check; :mod:`coordinator.core.quarantine`).
        workers: (role, local world size) of each participant, by rank, from the node
            records at completion; empty: not known
            (:mod:`coordinator.core.worker_kinds`).
        restarts: the job's counted restarts (:mod:`coordinator.core.restart_budget`).
    """

    round: int = 0
    closed: bool = False
    participants: tuple[str, ...] = ()
    wait_list: tuple[str, ...] = ()
    redundancy_list: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    closed_reason: str = ""
    master_addr: str = ""
    master_port: int = 0
    completed_at_unix_ms: int = 0
    written_by: str = ""
    close_mode: CloseMode = "unspecified"
    closed_at_unix_ms: int = 0
    incarnation: int = 1
    draining: tuple[str, ...] = ()
    hang: Hang | None = None
    quarantined: tuple[Quarantine, ...] = ()
    workers: tuple[tuple[str, int], ...] = ()
    restarts: RestartCount = field(default_factory=RestartCount)

    def quarantine_of(self, node_id: str) -> Quarantine | None:
        """The quarantine of ``node_id``, or None if it is not quarantined."""
        return next((q for q in self.quarantined if q.node_id == node_id), None)

    def rank_of(self, node_id: str) -> int | None:
        """The group rank of ``node_id`` in ``round``, or None if not a participant."""
        try:
            return self.participants.index(node_id)
        except ValueError:
            return None

    @property
    def num_waiting(self) -> int:
        """What ``num_nodes_waiting()`` reports: nodes waiting plus participants lost.

        A lost participant counts so that any agent, torch's included, re-rendezvouses at
        once instead of waiting for a collective to time out; so does a participant being
        drained or quarantined (it leaves: the others re-form without it, not a counted
        restart).
        """
        lost = set(self.lost)
        out = set(self.draining) | {q.node_id for q in self.quarantined}
        leaving = [n for n in self.participants if n in out and n not in lost]
        return len(self.wait_list) + len(self.lost) + len(leaving)


@dataclass(frozen=True)
class NodeInfo:
    """A node record: written by the node itself, bound to its lease."""

    node_id: str
    wanted_round: int
    addr: str = ""
    hostname: str = ""
    pid: int = 0
    local_world_size: int = 0
    role: str = ""
    lease_id: int = 0
    started_at_unix_ms: int = 0
    free_port: int = 0
    incarnation: int = 1
    # Not stored in the value: etcd's create_revision of the key (arrival order).
    create_revision: int = field(default=0, compare=False)


def _to_json(message: Message) -> bytes:
    # Compact separators: the state of a very large run must stay under etcd's 1.5 MiB
    # request limit; etcdctl output stays readable (one JSON object per value).
    # Every field, zero values included, so `etcdctl get` shows e.g. "closed":false.
    fields = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()


def _parse(key: str, raw: bytes, message: Message) -> None:
    try:
        json_format.Parse(raw.decode("utf-8"), message, ignore_unknown_fields=False)
    except (UnicodeDecodeError, json_format.ParseError) as exc:
        raise CorruptValueError(key, f"not a {type(message).__name__} in JSON ({exc})") from exc
    version = getattr(message, "schema_version", 0)
    if version == 0:
        raise CorruptValueError(key, "no schema_version: not written by etcd-elastic")
    if version > SCHEMA_VERSION:
        raise CorruptValueError(
            key,
            f"schema_version {version} is newer than this etcd-elastic understands "
            f"({SCHEMA_VERSION}); upgrade every agent of the run",
        )


def _check_port(key: str, field_name: str, port: int) -> None:
    if not 0 <= port <= _MAX_PORT:
        raise CorruptValueError(key, f"{field_name} {port} is not a TCP port (1..{_MAX_PORT})")


def _incarnation(key: str, value: int) -> int:
    # Absent (0) in values of schema_version 1, which knew one incarnation per run.
    if value < 0:
        raise CorruptValueError(key, f"negative incarnation {value}")
    if value > MAX_ROUND:
        raise CorruptValueError(key, f"incarnation {value} is out of range")
    return value or 1


def encode_state(state: RdzvState) -> bytes:
    msg = pb.RendezvousState(
        schema_version=SCHEMA_VERSION,
        round=state.round,
        complete=state.round > 0,
        closed=state.closed,
        participants=[pb.Participant(node_id=n, rank=r) for r, n in enumerate(state.participants)],
        wait_list=list(state.wait_list),
        redundancy_list=list(state.redundancy_list),
        lost=list(state.lost),
        closed_reason=state.closed_reason,
        completed_at_unix_ms=state.completed_at_unix_ms,
        written_by=state.written_by,
        master_addr=state.master_addr,
        master_port=state.master_port,
        close_mode=CLOSE_MODE_CODES[state.close_mode],  # type: ignore[arg-type]
        closed_at_unix_ms=state.closed_at_unix_ms,
        incarnation=state.incarnation,
        draining=list(state.draining),
        quarantined=[
            pb.Quarantine(
                node_id=q.node_id, reason=q.reason, until_unix_ms=q.until_unix_ms, addr=q.addr
            )
            for q in state.quarantined
        ],
        restarts=count_message(state.restarts),
    )
    put_workers(msg, state.workers)
    if state.hang is not None:
        h = state.hang
        msg.hang.CopyFrom(
            pb.Hang(
                round=h.round, nodes=list(h.nodes), step=h.step, behind=h.behind,
                declared_by=h.declared_by, stalled_ms=h.stalled_ms,
                declared_at_unix_ms=h.declared_at_unix_ms,
            )
        )  # fmt: skip
    return _to_json(msg)


def decode_state(key: str, raw: bytes) -> RdzvState:
    """Decode the state key's value; raises CorruptValueError naming ``key``.

    Cached per process (the value is immutable): every node of a process that watches the
    same run decodes each new state once, not once per node.
    """
    return _decode_state_cached(key, raw)


@functools.lru_cache(maxsize=16)
def _decode_state_cached(key: str, raw: bytes) -> RdzvState:
    msg = pb.RendezvousState()
    _parse(key, raw, msg)
    ranks = [p.rank for p in msg.participants]
    if ranks != list(range(len(ranks))):
        raise CorruptValueError(key, f"participant ranks {ranks} are not 0..{len(ranks) - 1}")
    ids = [p.node_id for p in msg.participants]
    twice = sorted({i for i in ids if ids.count(i) > 1}) if len(set(ids)) != len(ids) else []
    if twice:
        raise CorruptValueError(key, f"node {twice[0]!r} appears twice among the participants")
    if msg.round < 0:
        raise CorruptValueError(key, f"negative round {msg.round}")
    if msg.round > MAX_ROUND:
        raise CorruptValueError(
            key, f"round {msg.round} is out of range: the next round would not fit int64"
        )
    _check_port(key, "master_port", msg.master_port)
    return RdzvState(
        round=msg.round,
        closed=msg.closed,
        participants=tuple(ids),
        wait_list=tuple(msg.wait_list),
        redundancy_list=tuple(msg.redundancy_list),
        lost=tuple(msg.lost),
        closed_reason=msg.closed_reason,
        master_addr=msg.master_addr,
        master_port=msg.master_port,
        completed_at_unix_ms=msg.completed_at_unix_ms,
        written_by=msg.written_by,
        close_mode=close_mode_of(msg.close_mode),
        closed_at_unix_ms=msg.closed_at_unix_ms,
        incarnation=_incarnation(key, msg.incarnation),
        draining=tuple(msg.draining),
        hang=_hang(key, msg),
        quarantined=tuple(
            Quarantine(q.node_id, q.reason, q.until_unix_ms, q.addr) for q in msg.quarantined
        ),
        workers=read_workers(key, msg, len(ids)),
        restarts=count_of_message(key, msg.restarts, msg.round),
    )


def _hang(key: str, msg: pb.RendezvousState) -> Hang | None:
    if not msg.HasField("hang"):
        return None
    h = msg.hang
    if not 0 < h.round <= MAX_ROUND + 1 or not h.nodes:
        raise CorruptValueError(key, f"hang of round {h.round} names no node or no valid round")
    return Hang(
        round=h.round, nodes=tuple(h.nodes), step=h.step, behind=h.behind,
        declared_by=h.declared_by, stalled_ms=h.stalled_ms,
        declared_at_unix_ms=h.declared_at_unix_ms,
    )  # fmt: skip


def encode_node(node: NodeInfo) -> bytes:
    msg = pb.NodeRecord(
        schema_version=SCHEMA_VERSION,
        node_id=node.node_id,
        addr=node.addr,
        hostname=node.hostname,
        pid=node.pid,
        local_world_size=node.local_world_size,
        role=node.role,
        wanted_round=node.wanted_round,
        lease_id=node.lease_id,
        started_at_unix_ms=node.started_at_unix_ms,
        free_port=node.free_port,
        incarnation=node.incarnation,
    )
    return _to_json(msg)


def decode_node(key: str, raw: bytes, create_revision: int = 0) -> NodeInfo:
    """Decode a node key's value; raises CorruptValueError naming ``key``."""
    msg = pb.NodeRecord()
    _parse(key, raw, msg)
    if msg.wanted_round < 0:
        raise CorruptValueError(key, f"negative wanted_round {msg.wanted_round}")
    _check_port(key, "free_port", msg.free_port)
    return NodeInfo(
        node_id=msg.node_id,
        wanted_round=msg.wanted_round,
        addr=msg.addr,
        hostname=msg.hostname,
        pid=msg.pid,
        local_world_size=msg.local_world_size,
        role=msg.role,
        lease_id=msg.lease_id,
        started_at_unix_ms=msg.started_at_unix_ms,
        free_port=msg.free_port,
        incarnation=_incarnation(key, msg.incarnation),
        create_revision=create_revision,
    )

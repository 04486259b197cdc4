"""What each participant of a round runs, as the state stores it (``worker_kinds``).

When a round completes, the coordinator copies each participant's role and local world
size from its node record into the state, so every agent computes every worker's ranks
itself (``agent.loop.ranks``) instead of exchanging them through the round's store: no
write and no read per round. Stored compactly: the distinct (role, local world size)
pairs, and each participant's index into them, left out when there is one pair (every
participant runs the same, the usual case: under 100 bytes whatever the size of the
run). With ``MAX_WORKER_KINDS`` pairs the index costs at most 3 bytes a participant (about
39 kB at 10,000 nodes; ``tests/unit/test_state_codec.py`` keeps the state of 10,000 nodes
under etcd's request limit with every list full and every participant different from its
neighbour).
"""

from __future__ import annotations

from coordinator.core.errors import CorruptValueError
from coordinator.generated import rendezvous_pb2 as pb

__all__ = [
    "MAX_ROLE_LEN",
    "MAX_WORKER_KINDS",
    "Workers",
    "pack_workers",
    "put_workers",
    "read_workers",
]

Workers = tuple[tuple[str, int], ...]
"""(role, local world size) of each participant, by rank."""

MAX_WORKER_KINDS = 64
"""At most this many distinct (role, local world size) pairs in a state, with roles of at
most ``MAX_ROLE_LEN`` characters. A round with more is committed without them (its agents
then agree on ranks through the store)."""
MAX_ROLE_LEN = 128


def pack_workers(
    workers: Workers,
) -> tuple[Workers, tuple[int, ...]] | None:
    """``workers`` (one (role, local world size) per participant) as the state stores
    them: the distinct pairs in order of first use, and each participant's index into them
    (empty when there is one pair). None when they cannot be stored: a pair that is not
    valid (no role, a role longer than ``MAX_ROLE_LEN``, a size below 1) or more than
    ``MAX_WORKER_KINDS`` pairs."""
    kinds: dict[tuple[str, int], int] = {}
    for role, size in workers:
        if not role or len(role) > MAX_ROLE_LEN or size < 1:
            return None
        kinds.setdefault((role, size), len(kinds))
    if len(kinds) > MAX_WORKER_KINDS:
        return None
    index = () if len(kinds) <= 1 else tuple(kinds[w] for w in workers)
    return tuple(kinds), index


def put_workers(msg: pb.RendezvousState, workers: Workers) -> None:
    """Store ``workers`` in a state message, or nothing when they cannot be stored."""
    packed = pack_workers(workers) if workers else None
    if packed is not None:
        kinds, index = packed
        msg.worker_kinds.extend(pb.WorkerKind(role=r, local_world_size=n) for r, n in kinds)
        msg.worker_kind_of.extend(index)


def read_workers(key: str, msg: pb.RendezvousState, participants: int) -> Workers:
    """Each participant's (role, local world size) from a decoded state message.

    Raises:
        CorruptValueError: they are not what :func:`put_workers` writes (names ``key``).
    """
    kinds = [(k.role, k.local_world_size) for k in msg.worker_kinds]
    index = list(msg.worker_kind_of)
    if not kinds:
        if index:
            raise CorruptValueError(key, "worker_kind_of without worker_kinds")
        return ()
    if len(kinds) > MAX_WORKER_KINDS or any(
        not role or len(role) > MAX_ROLE_LEN or size < 1 for role, size in kinds
    ):
        raise CorruptValueError(key, f"worker_kinds {kinds[:3]!r}... are not what a node runs")
    if not index and len(kinds) == 1:
        return (kinds[0],) * participants
    if len(index) != participants or any(i >= len(kinds) for i in index):
        raise CorruptValueError(
            key, f"worker_kind_of has {len(index)} entries for {participants} participants "
            f"and {len(kinds)} worker kinds",
        )  # fmt: skip
    return tuple(kinds[i] for i in index)

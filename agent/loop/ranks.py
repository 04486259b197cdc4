"""Worker rank assignment and the master address of a round.

Ranks are computed by the pure :func:`assign` from what every agent of the round runs
(role, group rank, local world size). With our handler the round's state carries that
already (the coordinator copies it from the node records when it completes the round),
so every agent computes every rank itself: no store write, no store read. Otherwise
(torch's handlers, or a round whose records lack it) the agents agree through the
round's store: each writes what it runs, group rank 0 gathers them (one range read on our
store) and writes each agent its answer, and each agent reads its own. Nodes may run
different numbers of workers and different roles. Values are JSON text: nothing read
from the store is ever executed.

The master address is one key that group rank 0 writes and the others read.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.store import Store, gather_all
from agent.workers.launch import WorkerRanks
from coordinator.core.ports import free_port

__all__ = [
    "Assignment",
    "RoleInfo",
    "assign",
    "exchange_ranks",
    "publish_master",
]

# Our own key names: the round's store may also hold torch's keys (MASTER_ADDR, ...).
_ROLE_INFO = "etcd_elastic/role_info/"
_ASSIGNED = "etcd_elastic/assigned_ranks/"
_MASTER = "etcd_elastic/master"


@dataclass(frozen=True)
class RoleInfo:
    """What one agent runs: its role, its group rank and how many workers it starts."""

    role: str
    group_rank: int
    local_world_size: int


@dataclass(frozen=True)
class Assignment:
    """One agent's share: its workers hold ranks ``base + local_rank``."""

    base_global_rank: int
    world_size: int
    base_role_rank: int
    role_world_size: int

    def worker(self, local_rank: int) -> WorkerRanks:
        """The ranks of the worker with this local rank."""
        return WorkerRanks(
            local_rank=local_rank,
            global_rank=self.base_global_rank + local_rank,
            role_rank=self.base_role_rank + local_rank,
            world_size=self.world_size,
            role_world_size=self.role_world_size,
        )


def assign(infos: Sequence[RoleInfo]) -> dict[int, Assignment]:
    """Compute every agent's ranks.

    Global ranks are handed out in group-rank order, each agent taking a contiguous
    block as wide as its local world size; role ranks likewise, counted within the role.

    Args:
        infos: one entry per agent, group ranks exactly ``0..len(infos)-1`` in any order.

    Returns:
        group rank -> that agent's :class:`Assignment`.

    Raises:
        ValueError: group ranks are missing or repeated, a local world size is below 1,
            or a role name is empty.
    """
    ordered = sorted(infos, key=lambda info: info.group_rank)
    ranks = [info.group_rank for info in ordered]
    if ranks != list(range(len(ordered))):
        raise ValueError(f"group ranks must be exactly 0..{len(ordered) - 1}, got {ranks}")
    for info in ordered:
        if info.local_world_size < 1:
            raise ValueError(
                f"group rank {info.group_rank}: local world size must be >= 1, "
                f"got {info.local_world_size}"
            )
        if not info.role:
            raise ValueError(f"group rank {info.group_rank}: role name is empty")
    world_size = sum(info.local_world_size for info in ordered)
    role_sizes: dict[str, int] = {}
    for info in ordered:
        role_sizes[info.role] = role_sizes.get(info.role, 0) + info.local_world_size
    next_global = 0
    next_role: dict[str, int] = {}
    result: dict[int, Assignment] = {}
    for info in ordered:
        base_role = next_role.get(info.role, 0)
        result[info.group_rank] = Assignment(
            base_global_rank=next_global,
            world_size=world_size,
            base_role_rank=base_role,
            role_world_size=role_sizes[info.role],
        )
        next_global += info.local_world_size
        next_role[info.role] = base_role + info.local_world_size
    return result


def _decode_object(key: str, raw: bytes, fields: Mapping[str, type]) -> dict[str, object]:
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"store key {key!r}: not JSON ({exc}); was it written by us?") from exc
    if not isinstance(value, dict):
        raise ValueError(f"store key {key!r}: expected a JSON object, got {value!r}")
    for name, kind in fields.items():
        if not isinstance(value.get(name), kind) or isinstance(value.get(name), bool):
            raise ValueError(
                f"store key {key!r}: field {name!r} must be {kind.__name__}, "
                f"got {value.get(name)!r}"
            )
    return value


def _encode_info(info: RoleInfo) -> str:
    return json.dumps(
        {
            "role": info.role,
            "group_rank": info.group_rank,
            "local_world_size": info.local_world_size,
        }
    )


def _decode_info(key: str, raw: bytes) -> RoleInfo:
    value = _decode_object(key, raw, {"role": str, "group_rank": int, "local_world_size": int})
    return RoleInfo(
        role=str(value["role"]),
        group_rank=int(str(value["group_rank"])),
        local_world_size=int(str(value["local_world_size"])),
    )


_ASSIGNMENT_FIELDS = ("base_global_rank", "world_size", "base_role_rank", "role_world_size")


def _encode_assignment(assignment: Assignment) -> str:
    return json.dumps({name: getattr(assignment, name) for name in _ASSIGNMENT_FIELDS})


def _decode_assignment(key: str, raw: bytes) -> Assignment:
    value = _decode_object(key, raw, dict.fromkeys(_ASSIGNMENT_FIELDS, int))
    return Assignment(*(int(str(value[name])) for name in _ASSIGNMENT_FIELDS))


def exchange_ranks(
    store: Store,
    info: RoleInfo,
    group_world_size: int,
    workers: Sequence[tuple[str, int]] = (),
) -> Assignment:
    """Agree on ranks with the other agents of this round; returns this agent's share.

    Args:
        workers: (role, local world size) of every agent by group rank, as the round's
            state holds them (our handler); empty: unknown, exchange through ``store``.

    Blocks in the store (bounded by its timeout) until group rank 0 wrote this agent's
    answer; with ``workers`` it touches the store not at all.

    Raises:
        ValueError: a value in the store is not what an agent writes (names the key), or
            ``workers`` says this agent runs something else than it does.
    """
    if len(workers) == group_world_size:
        return _from_state(info, workers)
    store.set(f"{_ROLE_INFO}{info.group_rank}", _encode_info(info))
    if info.group_rank == 0:
        raws = gather_all(store, _ROLE_INFO, group_world_size)
        infos = [_decode_info(f"{_ROLE_INFO}{r}", raw) for r, raw in enumerate(raws)]
        for group_rank, assignment in assign(infos).items():
            store.set(f"{_ASSIGNED}{group_rank}", _encode_assignment(assignment))
    key = f"{_ASSIGNED}{info.group_rank}"
    return _decode_assignment(key, store.get(key))


def _from_state(info: RoleInfo, workers: Sequence[tuple[str, int]]) -> Assignment:
    """This agent's share, computed from what the round's state says every agent runs."""
    said = tuple(workers[info.group_rank])
    if said != (info.role, info.local_world_size):
        raise ValueError(
            f"the round's state says group rank {info.group_rank} runs {said[1]} worker(s) "
            f"of role {said[0]!r}, but this agent runs {info.local_world_size} of role "
            f"{info.role!r}; every agent of a run must report what it runs to its handler"
        )
    infos = [RoleInfo(role, rank, size) for rank, (role, size) in enumerate(workers)]
    return assign(infos)[info.group_rank]


def _encode_master(addr: str, port: int, agent_store: bool) -> str:
    return json.dumps({"addr": addr, "port": port, "agent_store": agent_store})


def _decode_master(raw: bytes) -> tuple[str, int, bool]:
    value = _decode_object(_MASTER, raw, {"addr": str, "port": int})
    port = int(str(value["port"]))
    if not 0 < port < 65536:
        raise ValueError(f"store key {_MASTER!r}: not a TCP port: {value['port']!r}")
    return str(value["addr"]), port, value.get("agent_store") is True


def publish_master(
    store: Store,
    group_rank: int,
    local_addr: str | None,
    master_addr: str | None = None,
    master_port: int | None = None,
    *,
    agent_store: bool = False,
) -> tuple[str, int, bool]:
    """Agree on MASTER_ADDR / MASTER_PORT for this round's workers: one store key.

    Group rank 0 publishes ``master_addr`` (default: ``local_addr``, else this host's
    fully qualified name), ``master_port`` (default: a port free on that address right
    now) and whether it hosts the workers' bootstrap store (``agent_store``); every other
    agent reads them (one read, blocking up to the store timeout until it is written).

    Returns:
        ``(master_addr, master_port, agent_store)`` as published by group rank 0.

    Raises:
        ValueError: the published value is not what an agent writes, or its port is not
            a number in 1..65535.
    """
    if group_rank == 0:
        addr = master_addr or local_addr or socket.getfqdn()
        port = master_port if master_port is not None else free_port(addr, fallback_any=True)
        store.set(_MASTER, _encode_master(addr, port, agent_store))
        return addr, port, agent_store
    return _decode_master(store.get(_MASTER))

"""Worker rank assignment and the master address, agreed through the round's store.

Every agent writes what it runs (role, group rank, local world size); group rank 0 reads
them all, computes every agent's ranks with the pure :func:`assign` and writes each
agent its own answer; every agent then reads its own. Nodes may run different numbers
of workers and different roles. Values are JSON text: nothing read from the store is
ever executed.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.store import Store
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
_MASTER_ADDR = "etcd_elastic/master_addr"
_MASTER_PORT = "etcd_elastic/master_port"


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


def exchange_ranks(store: Store, info: RoleInfo, group_world_size: int) -> Assignment:
    """Agree on ranks with the other agents of this round; returns this agent's share.

    Blocks in ``store.get`` (bounded by the store's timeout) until group rank 0 wrote it.

    Raises:
        ValueError: a value in the store is not what an agent writes (names the key).
    """
    store.set(f"{_ROLE_INFO}{info.group_rank}", _encode_info(info))
    if info.group_rank == 0:
        keys = [f"{_ROLE_INFO}{rank}" for rank in range(group_world_size)]
        infos = [_decode_info(k, raw) for k, raw in zip(keys, store.multi_get(keys), strict=True)]
        for group_rank, assignment in assign(infos).items():
            store.set(f"{_ASSIGNED}{group_rank}", _encode_assignment(assignment))
    key = f"{_ASSIGNED}{info.group_rank}"
    return _decode_assignment(key, store.get(key))


def publish_master(
    store: Store,
    group_rank: int,
    local_addr: str | None,
    master_addr: str | None = None,
    master_port: int | None = None,
) -> tuple[str, int]:
    """Agree on MASTER_ADDR / MASTER_PORT for this round's workers.

    Group rank 0 publishes ``master_addr`` (default: ``local_addr``, else this host's
    fully qualified name) and ``master_port`` (default: a port free on that address
    right now); every agent, rank 0 included, reads the published pair.

    Returns:
        ``(master_addr, master_port)`` as published by group rank 0.

    Raises:
        ValueError: the published port is not a number in 1..65535.
    """
    if group_rank == 0:
        addr = master_addr or local_addr or socket.getfqdn()
        port = master_port if master_port is not None else free_port(addr, fallback_any=True)
        store.set(_MASTER_ADDR, addr)
        store.set(_MASTER_PORT, str(port))
    addr_read = store.get(_MASTER_ADDR).decode("utf-8")
    port_text = store.get(_MASTER_PORT).decode("utf-8")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"store key {_MASTER_PORT!r}: not a TCP port: {port_text!r}")
    return addr_read, int(port_text)

"""Rank assignment: the pure computation, and the store exchange over torch's HashStore."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore

from agent.loop.ranks import (
    Assignment,
    RoleInfo,
    WorkerRanks,
    assign,
    exchange_ranks,
    publish_master,
)

A = Assignment

CASES: list[tuple[str, list[RoleInfo], dict[int, Assignment]]] = [
    ("one node", [RoleInfo("t", 0, 4)], {0: A(0, 4, 0, 4)}),
    (
        "same nproc",
        [RoleInfo("t", 0, 2), RoleInfo("t", 1, 2), RoleInfo("t", 2, 2)],
        {0: A(0, 6, 0, 6), 1: A(2, 6, 2, 6), 2: A(4, 6, 4, 6)},
    ),
    (
        "different nproc per node",
        [RoleInfo("t", 0, 3), RoleInfo("t", 1, 1), RoleInfo("t", 2, 2)],
        {0: A(0, 6, 0, 6), 1: A(3, 6, 3, 6), 2: A(4, 6, 4, 6)},
    ),
    (
        "two roles interleaved",
        [RoleInfo("a", 0, 2), RoleInfo("b", 1, 1), RoleInfo("a", 2, 2), RoleInfo("b", 3, 3)],
        {0: A(0, 8, 0, 4), 1: A(2, 8, 0, 4), 2: A(3, 8, 2, 4), 3: A(5, 8, 1, 4)},
    ),
    (
        "given out of order",
        [RoleInfo("t", 1, 1), RoleInfo("t", 0, 2)],
        {0: A(0, 3, 0, 3), 1: A(2, 3, 2, 3)},
    ),
]


@pytest.mark.parametrize(("name", "infos", "expected"), CASES, ids=[c[0] for c in CASES])
def test_assign(name: str, infos: list[RoleInfo], expected: dict[int, Assignment]) -> None:
    assert assign(infos) == expected


def test_every_rank_exactly_once() -> None:
    infos = [RoleInfo("ab"[i % 2], i, 1 + i % 3) for i in range(10)]
    result = assign(infos)
    workers = [result[i.group_rank].worker(lr) for i in infos for lr in range(i.local_world_size)]
    assert sorted(w.global_rank for w in workers) == list(range(len(workers)))
    for role in "ab":
        ranks = sorted(
            result[i.group_rank].worker(lr).role_rank
            for i in infos
            if i.role == role
            for lr in range(i.local_world_size)
        )
        assert ranks == list(range(len(ranks)))


def test_worker_ranks() -> None:
    assert A(4, 8, 1, 4).worker(2) == WorkerRanks(2, 6, 3, 8, 4)


@pytest.mark.parametrize(
    ("infos", "message"),
    [
        (
            [RoleInfo("t", 0, 1), RoleInfo("t", 2, 1)],
            "group ranks must be exactly 0..1, got [0, 2]",
        ),
        (
            [RoleInfo("t", 0, 1), RoleInfo("t", 0, 1)],
            "group ranks must be exactly 0..1, got [0, 0]",
        ),
        ([RoleInfo("t", 0, 0)], "group rank 0: local world size must be >= 1, got 0"),
        ([RoleInfo("", 0, 1)], "group rank 0: role name is empty"),
    ],
)
def test_assign_rejects(infos: list[RoleInfo], message: str) -> None:
    with pytest.raises(ValueError) as err:
        assign(infos)
    assert str(err.value) == message


def _run_agents(n: int, body: object) -> list[object]:
    results: list[object] = [None] * n
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    return results


def test_exchange_through_store() -> None:
    store = HashStore()
    sizes = [2, 1, 3]
    got = _run_agents(3, lambda r: exchange_ranks(store, RoleInfo("t", r, sizes[r]), 3))
    assert got == [A(0, 6, 0, 6), A(2, 6, 2, 6), A(3, 6, 3, 6)]


def test_exchange_rejects_foreign_value() -> None:
    store = HashStore()
    store.set("etcd_elastic/role_info/1", "not json")

    with pytest.raises(ValueError) as err:
        exchange_ranks(store, RoleInfo("t", 0, 1), 2)
    assert str(err.value).startswith(
        "store key 'etcd_elastic/role_info/1': not JSON (Expecting value"
    )
    assert str(err.value).endswith("was it written by us?")


def test_publish_master_picks_free_port() -> None:
    store = HashStore()
    got = _run_agents(3, lambda r: publish_master(store, r, "127.0.0.1", agent_store=r == 0))
    addr, port, agent_store = got[0]  # type: ignore[misc]
    assert (addr, agent_store) == ("127.0.0.1", True)
    assert 0 < port < 65536
    assert got == [got[0]] * 3


def test_publish_master_overrides() -> None:
    store = HashStore()
    got = _run_agents(2, lambda r: publish_master(store, r, "127.0.0.1", "10.1.2.3", 29500))
    assert got == [("10.1.2.3", 29500, False)] * 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{"addr": "h", "port": 70000}', "store key 'etcd_elastic/master': not a TCP port: 70000"),
        ('{"addr": "h", "port": "1"}', "store key 'etcd_elastic/master': field 'port' must be int"),
        ("h:1", "store key 'etcd_elastic/master': not JSON"),
    ],
)
def test_publish_master_rejects_what_no_agent_writes(value: str, message: str) -> None:
    store = HashStore()
    store.set("etcd_elastic/master", value)
    with pytest.raises(ValueError) as err:
        publish_master(store, 1, None)
    assert str(err.value).startswith(message)


# -- ranks from the round's state (our handler): no store at all ----------------------------


class NoStore:
    """A store that fails the test if the exchange touches it."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the exchange used the store ({name}) though the state said all")


def test_ranks_from_the_state_are_the_store_exchange_s() -> None:
    workers = (("a", 2), ("b", 1), ("a", 2), ("b", 3))
    infos = [RoleInfo(role, r, size) for r, (role, size) in enumerate(workers)]
    shared = HashStore()
    through_store = _run_agents(4, lambda r: exchange_ranks(shared, infos[r], 4))
    from_state = [exchange_ranks(NoStore(), info, 4, workers) for info in infos]  # type: ignore[arg-type]
    assert from_state == through_store == [assign(infos)[r] for r in range(4)]


def test_ranks_from_a_state_that_disagrees_with_the_agent_are_refused() -> None:
    with pytest.raises(ValueError) as err:
        exchange_ranks(NoStore(), RoleInfo("t", 1, 4), 2, (("t", 4), ("t", 8)))  # type: ignore[arg-type]
    assert str(err.value) == (
        "the round's state says group rank 1 runs 8 worker(s) of role 't', but this agent "
        "runs 4 of role 't'; every agent of a run must report what it runs to its handler"
    )


def test_a_state_without_workers_falls_back_to_the_store() -> None:
    store = HashStore()
    got = _run_agents(2, lambda r: exchange_ranks(store, RoleInfo("t", r, 1), 2, ()))
    assert got == [A(0, 2, 0, 2), A(1, 2, 1, 2)]

"""The Store contract, run against our EtcdStore (real etcd) and torch's own TCPStore.

Every test takes ``backend``, which opens handles on a round's store; TCPStore proves
that each expectation is torch's behaviour, not just ours. A "round" of the TCP
reference is a TCPStore server of its own. Tests that look at etcd itself (keys staying
inside the round's folder, cleanup of old rounds) are in ``test_store_etcd.py``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError, PrefixStore, Store

from coordinator.torch_adapter.store import EtcdStore
from tests.integration.store_support import (  # noqa: F401 (fixtures)
    LONG,
    ODD_KEYS,
    PROMPT_S,
    SHORT,
    Backend,
    Later,
    backend_fixture,
    store_fixture,
)

pytestmark = pytest.mark.integration


# -- set / get ------------------------------------------------------------------------------


def test_set_get_overwrite(store: Store) -> None:
    store.set("k", "v1")
    assert store.get("k") == b"v1"
    store.set("k", b"\x00\xffv2")
    assert store.get("k") == b"\x00\xffv2"
    store.set("empty", "")
    assert store.get("empty") == b""


def test_get_blocks_until_another_handle_sets(backend: Backend) -> None:
    reader, writer = backend.open(0, LONG), backend.open(0, LONG)
    start = time.monotonic()
    with Later(0.3, lambda: writer.set("late", "here")):
        assert reader.get("late") == b"here"
    assert time.monotonic() - start < PROMPT_S


def test_get_times_out_with_dist_store_error(backend: Backend) -> None:
    short = backend.open(0, SHORT)
    start = time.monotonic()
    with pytest.raises(DistStoreError):
        short.get("never")
    assert 0.4 <= time.monotonic() - start < PROMPT_S


def test_set_timeout_changes_the_default(backend: Backend) -> None:
    handle = backend.open(0, LONG)
    handle.set_timeout(SHORT)
    start = time.monotonic()
    with pytest.raises(DistStoreError):
        handle.get("never")
    assert time.monotonic() - start < PROMPT_S


# -- wait / check ---------------------------------------------------------------------------


def test_wait_returns_when_keys_exist(backend: Backend) -> None:
    waiter, writer = backend.open(0, LONG), backend.open(0, LONG)
    writer.set("a", "1")
    start = time.monotonic()
    with Later(0.3, lambda: writer.set("b", "2")):
        waiter.wait(["a", "b"])
    with Later(0.3, lambda: writer.set("c", "3")):
        waiter.wait(["c"], LONG)
    assert time.monotonic() - start < PROMPT_S
    waiter.wait([])


def test_wait_times_out(store: Store) -> None:
    store.set("a", "1")
    start = time.monotonic()
    with pytest.raises(DistStoreError):
        store.wait(["a", "missing"], SHORT)
    assert 0.4 <= time.monotonic() - start < PROMPT_S


def test_wait_with_zero_timeout_checks_once(store: Store) -> None:
    with pytest.raises(DistStoreError):
        store.wait(["missing"], timedelta(0))
    store.set("there", "1")
    # Ours reads once and answers; torch's TCPStore polls its socket for 0 ms, which a
    # loaded machine can miss, so the reference gets a real bound for the present key.
    store.wait(["there"], timedelta(0) if isinstance(store, EtcdStore) else timedelta(seconds=30))


def test_check(store: Store) -> None:
    assert store.check([])
    assert not store.check(["x"])
    store.set("x", "1")
    assert store.check(["x"])
    assert not store.check(["x", "y"])


# -- delete / num_keys / list_keys -----------------------------------------------------------


def test_delete_key_and_num_keys(store: Store) -> None:
    before = store.num_keys()
    store.set("d1", "1")
    store.set("d2", "2")
    assert store.num_keys() == before + 2
    assert store.delete_key("d1") is True
    assert store.delete_key("d1") is False
    assert not store.check(["d1"])
    assert store.num_keys() == before + 1


def test_list_keys(store: Store) -> None:
    for key in ("k1", "a/b", "ü"):
        store.set(key, "v")
    assert {"k1", "a/b", "ü"} <= set(store.list_keys())


# -- add ------------------------------------------------------------------------------------


def test_add_creates_and_returns_new_value(store: Store) -> None:
    assert store.add("c", 5) == 5
    assert store.add("c", -2) == 3
    assert store.add("c", 0) == 3
    assert store.get("c") == b"3"
    assert store.add("zero", 0) == 0
    assert store.check(["zero"])


def test_add_is_atomic_across_threads(backend: Backend) -> None:
    handles = [backend.open(0, LONG) for _ in range(8)]
    errors: list[BaseException] = []

    def work(handle: Store) -> None:
        try:
            for _ in range(50):
                handle.add("counter", 1)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not [t for t in threads if t.is_alive()]
    assert errors == []
    assert handles[0].get("counter") == b"400"


# -- compare_set ------------------------------------------------------------------------------


def test_compare_set_cases(store: Store) -> None:
    # absent, expected empty: set
    assert store.compare_set("k", "", "first") == b"first"
    assert store.get("k") == b"first"
    # present, expected matches: swap
    assert store.compare_set("k", "first", "second") == b"second"
    # present, expected differs: unchanged, returns the current value
    assert store.compare_set("k", "nope", "third") == b"second"
    assert store.compare_set("k", "", "third") == b"second"
    assert store.get("k") == b"second"
    # absent, expected not empty: not created, returns expected
    assert store.compare_set("absent", "exp", "des") == b"exp"
    assert not store.check(["absent"])
    # absent, expected and desired empty: created empty
    assert store.compare_set("blank", "", "") == b""
    assert store.check(["blank"])


def test_compare_set_has_one_winner(backend: Backend) -> None:
    handles = [backend.open(0, LONG) for _ in range(6)]
    results: list[bytes] = []
    lock = threading.Lock()

    def race(i: int, handle: Store) -> None:
        got = handle.compare_set("leader", "", f"node{i}")
        with lock:
            results.append(got)

    threads = [threading.Thread(target=race, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winner = handles[0].get("leader")
    assert results == [winner] * len(handles)


# -- multi_get / multi_set / append ------------------------------------------------------------


def test_multi_set_and_multi_get(store: Store) -> None:
    store.multi_set(["m1", "m2", "m1"], ["a", b"b", "c"])
    assert store.multi_get(["m1", "m2"]) == [b"c", b"b"]
    assert store.multi_get([]) == []
    store.multi_set([], [])


def test_multi_set_length_mismatch(store: Store) -> None:
    with pytest.raises(DistStoreError):
        store.multi_set(["a"], ["1", "2"])


def test_multi_get_blocks_and_times_out(backend: Backend) -> None:
    reader, writer = backend.open(0, LONG), backend.open(0, LONG)
    writer.set("g1", "1")
    with Later(0.3, lambda: writer.set("g2", "2")):
        assert reader.multi_get(["g1", "g2"]) == [b"1", b"2"]
    short = backend.open(0, SHORT)
    with pytest.raises(DistStoreError):
        short.multi_get(["g1", "never"])


def test_clone_shares_the_store(store: Store) -> None:
    twin = store.clone()
    twin.set("from-twin", "1")
    assert store.get("from-twin") == b"1"
    store.set("from-original", "2")
    assert twin.get("from-original") == b"2"
    assert twin.timeout == store.timeout


def test_append(store: Store) -> None:
    store.append("log", "a")
    store.append("log", b"b")
    store.append("log", "c")
    assert store.get("log") == b"abc"
    assert store.has_extended_api() is True


# -- keys, rounds, torch's wrappers ---------------------------------------------------------------


def test_odd_keys_round_trip_and_stay_apart(store: Store) -> None:
    for i, key in enumerate(ODD_KEYS):
        store.set(key, f"v{i}")
    for i, key in enumerate(ODD_KEYS):
        assert store.get(key) == f"v{i}".encode()
    assert store.check(ODD_KEYS)


def test_rounds_do_not_see_each_other(backend: Backend) -> None:
    one, two = backend.open(1, SHORT), backend.open(2, SHORT)
    base_one, base_two = one.num_keys(), two.num_keys()
    one.set("k", "one")
    two.set("k", "two")
    one.set("only-one", "1")
    assert (one.get("k"), two.get("k")) == (b"one", b"two")
    assert not two.check(["only-one"])
    with pytest.raises(DistStoreError):
        two.get("only-one")
    assert (one.num_keys(), two.num_keys()) == (base_one + 2, base_two + 1)


def test_prefix_store_over_it(store: Store) -> None:
    # torch wraps the agent's store in PrefixStore (C++ calling our Python methods).
    wrapped = PrefixStore("torchelastic", store)
    wrapped.set("rank0", "addr")
    assert wrapped.get("rank0") == b"addr"
    assert wrapped.add("n", 2) == 2
    assert store.get("torchelastic/rank0") == b"addr"
    assert wrapped.compare_set("c", "", "x") == b"x"
    wrapped.wait(["rank0"], LONG)
    assert wrapped.check(["n"])

"""The Store contract, run against our EtcdStore (real etcd) and torch's own TCPStore.

Every test takes ``backend``, which opens handles on a round's store; TCPStore proves
that each expectation is torch's behaviour, not just ours. A "round" of the TCP
reference is a TCPStore server of its own. Tests that look at etcd itself (keys staying
inside the round's folder, cleanup of old rounds) run on etcd only.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import etcd3
import pytest
from torch.distributed import DistStoreError, PrefixStore, Store, TCPStore

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys, encode_store_key
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore, delete_round, delete_rounds_before

pytestmark = pytest.mark.integration

LONG = timedelta(seconds=30)
SHORT = timedelta(seconds=0.5)
# A blocked get must return this much sooner than its timeout once the key is set.
PROMPT_S = 10.0


@dataclass
class Backend:
    """Opens handles on per-round stores of one implementation."""

    name: str
    open: Callable[[int, timedelta], Store]
    client: EtcdClient | None = None
    keys: RunKeys | None = None
    _cleanup: list[Callable[[], None]] = field(default_factory=list)


@contextlib.contextmanager
def _etcd_backend(cluster: EtcdCluster, run_id: str) -> Iterator[Backend]:
    client = EtcdClient(EtcdConfig(endpoints=tuple(cluster.endpoints)))
    keys = RunKeys("/etcd-elastic-test", run_id)
    try:
        yield Backend(
            "etcd",
            lambda round_, timeout: EtcdStore(client, keys.store_prefix(round_), timeout),
            client=client,
            keys=keys,
        )
    finally:
        client.delete_prefix(keys.run_prefix)
        client.close()


def _tcp_backend() -> Iterator[Backend]:
    servers: dict[int, TCPStore] = {}
    handles: list[TCPStore] = []

    def open_(round_: int, timeout: timedelta) -> Store:
        if round_ not in servers:
            servers[round_] = TCPStore(
                "127.0.0.1", 0, None, True, timeout=timeout, wait_for_workers=False
            )
        handle = TCPStore("127.0.0.1", servers[round_].port, None, False, timeout=timeout)
        handles.append(handle)
        return handle

    try:
        yield Backend("tcp", open_)
    finally:
        handles.clear()
        servers.clear()


@pytest.fixture(params=["etcd", "tcp"])
def backend(
    request: pytest.FixtureRequest, run_id: str, no_leaked_threads: None
) -> Iterator[Backend]:
    if request.param == "etcd":
        cluster: EtcdCluster = request.getfixturevalue("etcd1")
        with _etcd_backend(cluster, run_id) as etcd_backend:
            yield etcd_backend
    else:
        yield from _tcp_backend()


@pytest.fixture
def store(backend: Backend) -> Store:
    return backend.open(0, LONG)


class Later:
    """Runs ``action`` on a thread after ``delay`` seconds; always joined by the test."""

    def __init__(self, delay: float, action: Callable[[], Any]) -> None:
        self._timer = threading.Timer(delay, action)
        self._timer.start()

    def __enter__(self) -> Later:
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._timer.join(timeout=30)


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

ODD_KEYS = ["a/b", "..", "../../state", "/", "", "é✓", "%2F", "with space", "x" * 300]


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


# -- etcd only: where keys live, cleanup --------------------------------------------------


@pytest.fixture
def etcd(etcd1: EtcdCluster, run_id: str) -> Iterator[Backend]:
    with _etcd_backend(etcd1, run_id) as backend:
        yield backend


def test_odd_keys_stay_inside_the_round_folder(etcd: Backend) -> None:
    assert etcd.client is not None and etcd.keys is not None
    store = etcd.open(3, LONG)
    for key in [*ODD_KEYS, b"\x00\xff/..", "/../../../state"]:
        store.set(key, "v")
    prefix = etcd.keys.store_prefix(3)
    kvs, _ = etcd.client.get_prefix(etcd.keys.run_prefix)
    assert kvs, "nothing was written"
    for kv in kvs:
        assert kv.key.startswith(prefix)
        assert b"/" not in kv.key[len(prefix) :]
    assert {kv.key for kv in kvs} >= {prefix + encode_store_key(b"\x00\xff/..")}
    assert etcd.client.get(etcd.keys.state)[0] is None


def test_timeout_message_names_keys_and_store(etcd: Backend) -> None:
    assert etcd.keys is not None
    store = etcd.open(0, SHORT)
    with pytest.raises(DistStoreError) as exc:
        store.wait(["never"])
    message = str(exc.value)
    prefix = etcd.keys.store_prefix(0).decode()
    assert message.startswith("wait timeout after ")
    assert message.endswith(
        f"ms, keys: 'never' (etcd store {prefix}); raise the store timeout "
        "(rdzv_conf timeout=SECONDS) or check that the process that sets these keys is alive"
    )


def test_add_on_text_value_names_the_key(etcd: Backend) -> None:
    store = etcd.open(0, LONG)
    store.set("t", "abc")
    with pytest.raises(DistStoreError) as exc:
        store.add("t", 1)
    assert str(exc.value) == (
        "add on store key 't': its value b'abc' is not a decimal integer; "
        "use a key that only add() writes"
    )


def test_cleanup_of_old_rounds(etcd: Backend) -> None:
    assert etcd.client is not None and etcd.keys is not None
    client, keys = etcd.client, etcd.keys
    for round_ in (0, 1, 2, 10):
        store = etcd.open(round_, LONG)
        store.set("a", "1")
        store.set("b/c", "2")
    client.put(keys.store_root + b"foreign/x", b"not ours")
    client.put(keys.state, b"state")

    assert delete_rounds_before(client, keys.store_root, 2) == 4
    assert [etcd.open(r, LONG).num_keys() for r in (0, 1, 2, 10)] == [0, 0, 2, 2]
    assert delete_round(client, keys.store_root, 10) == 2
    assert delete_round(client, keys.store_root, 10) == 0
    assert etcd.open(2, LONG).get("b/c") == b"2"
    assert client.get(keys.store_root + b"foreign/x")[0] is not None
    assert client.get(keys.state)[0] is not None
    assert delete_rounds_before(client, keys.store_root, 100) == 2


def test_cleanup_rejects_bad_arguments(etcd: Backend) -> None:
    assert etcd.client is not None and etcd.keys is not None
    with pytest.raises(ValueError, match=r"^round -1 must be a non-negative int$"):
        delete_rounds_before(etcd.client, etcd.keys.store_root, -1)
    with pytest.raises(ValueError, match=r"must end with '/'$"):
        delete_round(etcd.client, etcd.keys.store_root.rstrip(b"/"), 1)


def test_store_prefix_must_be_a_folder(etcd: Backend) -> None:
    assert etcd.client is not None
    with pytest.raises(ValueError, match=r"^store prefix b'/x' must end with '/'$"):
        EtcdStore(etcd.client, b"/x", LONG)


def test_blocked_get_works_on_a_three_member_cluster(etcd3: EtcdCluster, run_id: str) -> None:
    with _etcd_backend(etcd3, run_id) as backend:
        reader, writer = backend.open(0, LONG), backend.open(0, LONG)
        start = time.monotonic()
        with Later(0.3, lambda: writer.set("k", "v")):
            assert reader.get("k") == b"v"
        assert time.monotonic() - start < PROMPT_S
        assert reader.add("n", 1) == 1


class _CompactBeforeFirstWatch(EtcdClient):
    """A real client that compacts etcd's history just before its first watch starts,
    so that watch asks for a revision etcd no longer has (as after a long GC pause)."""

    def __init__(self, config: EtcdConfig, scratch_key: bytes) -> None:
        super().__init__(config)
        self.watch_starts: list[int] = []
        self._scratch_key = scratch_key

    def watch(self, key: bytes, start_revision: int, *args: Any, **kwargs: Any) -> Any:
        if not self.watch_starts:
            self.put(self._scratch_key, b"1")
            revision = self.put(self._scratch_key, b"2")
            host, port = self.config.endpoints[0].rsplit(":", 1)
            raw = etcd3.client(host=host, port=int(port))
            try:
                raw.compact(revision, physical=True)
            finally:
                raw.close()
        self.watch_starts.append(start_revision)
        return super().watch(key, start_revision, *args, **kwargs)


def test_get_survives_a_compaction_just_before_its_watch(etcd1: EtcdCluster, run_id: str) -> None:
    keys = RunKeys("/etcd-elastic-test", run_id)
    config = EtcdConfig(endpoints=tuple(etcd1.endpoints))
    client = _CompactBeforeFirstWatch(config, keys.run_prefix + b"scratch")
    try:
        reader = EtcdStore(client, keys.store_prefix(0), LONG)
        writer = EtcdStore(client, keys.store_prefix(0), LONG)
        start = time.monotonic()
        with Later(0.5, lambda: writer.set("k", "v")):
            assert reader.get("k") == b"v"
        assert time.monotonic() - start < PROMPT_S
        # The store watches from now (revision 0), so it asks for no history that a
        # compaction could have removed: one watch was enough.
        assert client.watch_starts == [0]
    finally:
        client.delete_prefix(keys.run_prefix)
        client.close()


_PG_WORKER = """
import datetime, sys
import torch
import torch.distributed as dist
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.torch_adapter.store import EtcdStore

endpoint, prefix, rank = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3])
client = EtcdClient(EtcdConfig(endpoints=(endpoint,)))
store = EtcdStore(client, prefix, datetime.timedelta(seconds=60))
dist.init_process_group(
    "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
)
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
dist.barrier()
dist.destroy_process_group()
client.close()
print(f"sum={value.item():g}")
"""


@pytest.mark.slow
def test_gloo_process_group_forms_over_the_store(
    etcd1: EtcdCluster, run_id: str, tmp_path: Path
) -> None:
    # torch's C++ side (ProcessGroupGloo) drives our Python methods through the trampoline.
    script = tmp_path / "worker.py"
    script.write_text(_PG_WORKER)
    prefix = RunKeys("/etcd-elastic-test", run_id).store_prefix(0).decode()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), etcd1.endpoints[0], prefix, str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert out.strip().endswith("sum=3"), out


def _watchers(cluster: EtcdCluster) -> int:
    for line in cluster.members[0].metrics().splitlines():
        if line.startswith("etcd_debugging_mvcc_watcher_total "):
            return int(float(line.split()[1]))
    raise AssertionError("etcd exposes no etcd_debugging_mvcc_watcher_total metric")


def test_blocking_reads_cancel_their_watches(etcd1: EtcdCluster, etcd: Backend) -> None:
    baseline = _watchers(etcd1)
    reader, writer = etcd.open(0, LONG), etcd.open(0, LONG)
    for i in range(10):
        with Later(0.05, lambda i=i: writer.set(f"w{i}", "v")):
            reader.wait([f"w{i}"])
    short = etcd.open(0, timedelta(seconds=0.2))
    for _ in range(3):
        with pytest.raises(DistStoreError):
            short.get("never")
    # Cancelling is one message on the shared stream; etcd counts it shortly after.
    deadline = time.monotonic() + 10
    while _watchers(etcd1) > baseline and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert _watchers(etcd1) == baseline

"""``EtcdStore.gather`` and ``count_keys``: every key under a prefix with one range read,
a wait for more that watches the prefix (never a get per key, never a poll), and what it
returns at its deadline or when aborted. Real etcd; calls counted by a counting observer."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError

from benchmarks.etcd_counts import WATCH, RequestCounter, count_watches
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore
from tests.integration.store_support import LONG, Later

pytestmark = pytest.mark.integration


@pytest.fixture
def counted(etcd1: EtcdCluster, run_id: str) -> Iterator[tuple[EtcdStore, RequestCounter]]:
    counter = RequestCounter()
    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)), observer=counter)
    count_watches(client, counter)
    keys = RunKeys("/etcd-elastic-test", run_id)
    try:
        yield EtcdStore(client, keys.store_prefix(1), LONG), counter
    finally:
        client.delete_prefix(keys.run_prefix)
        client.close()


def _calls(counter: RequestCounter) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_thread, method), count in counter.take().items():
        out[method] = out.get(method, 0) + count
    return out


def test_keys_already_there_cost_one_range_read(
    counted: tuple[EtcdStore, RequestCounter],
) -> None:
    store, counter = counted
    for i in range(20):
        store.set(f"results/{i}", f"r{i}")
    store.set("resultsX", "not under the prefix")
    store.set("other/1", "elsewhere")
    counter.take()
    found = store.gather("results/", 20)
    assert found == {f"results/{i}": f"r{i}".encode() for i in range(20)}
    assert _calls(counter) == {"get_prefix": 1}
    assert store.count_keys("results/") == 20 and store.count_keys("nothing/") == 0
    assert _calls(counter) == {"count_prefix": 2}


def test_a_wait_for_more_watches_the_prefix_and_reads_twice(
    counted: tuple[EtcdStore, RequestCounter],
) -> None:
    store, counter = counted
    store.set("r/0", "a")
    counter.take()

    def put_the_rest() -> None:
        for i in range(1, 10):
            store.set(f"r/{i}", str(i))

    start = time.monotonic()
    with Later(0.3, put_the_rest):
        found = store.gather("r/", 10)
    assert sorted(found) == [f"r/{i}" for i in range(10)]
    assert time.monotonic() - start < 10  # not the store timeout (30 s)
    calls = {m: c for (t, m), c in counter.take().items() if t == threading.current_thread().name}
    # Whatever the number of keys awaited: one read, a watch and a second read (one read
    # if a slow start found them all there already); never a get per key.
    assert calls in ({"get_prefix": 2, WATCH: 1}, {"get_prefix": 1}), calls


def test_at_the_deadline_it_returns_those_there(counted: tuple[EtcdStore, RequestCounter]) -> None:
    store, _ = counted
    store.set("r/0", "a")
    start = time.monotonic()
    assert store.gather("r/", 3, timedelta(seconds=0.5)) == {"r/0": b"a"}
    assert 0.4 < time.monotonic() - start < 10


def test_a_key_deleted_while_waiting_no_longer_counts(
    counted: tuple[EtcdStore, RequestCounter],
) -> None:
    store, _ = counted
    store.set("r/0", "a")

    def delete_then_put() -> None:
        store.delete_key("r/0")
        store.set("r/1", "b")

    with Later(0.3, delete_then_put):
        found = store.gather("r/", 2, timedelta(seconds=1.5))
    assert found == {"r/1": b"b"}


def test_an_abort_ends_the_wait_at_once(counted: tuple[EtcdStore, RequestCounter]) -> None:
    store, _ = counted
    start = time.monotonic()
    with (
        Later(0.3, lambda: store.abort("the membership changed")),
        pytest.raises(
            DistStoreError, match="wait for store keys 'r/'\\* aborted: the membership changed"
        ),
    ):
        store.gather("r/", 2)
    assert time.monotonic() - start < 10


def test_torch_s_rank_exchange_at_200_nodes_fits_etcd_s_transactions_and_reads_once(
    counted: tuple[EtcdStore, RequestCounter],
) -> None:
    """torch's agent sets one key per node with one multi_set and rank 0 reads them with
    one multi_get (torchrun with our handler): etcd refuses a transaction of more than 128
    operations, and a get per key was 200 round trips."""
    store, counter = counted
    keys = [f"torchelastic/role_info/{i}" for i in range(200)]
    store.multi_set(keys, [f"v{i}" for i in range(200)])
    assert _calls(counter) == {"get": 2, "put_if_mod_revision": 2}  # two batches of 100
    store.set("torchelastic/role_infoX", "not asked for")
    counter.take()
    assert store.multi_get(keys) == [f"v{i}".encode() for i in range(200)]
    assert store.check(keys) and not store.check([*keys, "absent"])
    assert _calls(counter) == {"get_prefix": 3}

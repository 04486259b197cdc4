"""etcd's errors reach a Store's caller as torch's store errors (issue 21 item 2).

torch's callers of a Store (its ``elastic.utils.store``, its agent, our agent's rank
exchange and pre-flight check) catch ``DistStoreError`` (and ``TCPStore`` raises
``DistNetworkError`` when its server is gone). An etcd outage, or an etcd user whose role
may not write the round's ``store/`` keys, used to reach them as the core's
``EtcdConnectionError`` / ``EtcdAuthError``, which none of them catches: a traceback.
Both faults are put where they hurt: after the round formed, at the Store's calls.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from torch.distributed import DistNetworkError, DistStoreError

from coordinator.core import errors as core
from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore
from tests.etcd_auth import enable_auth, run_grants_without_store_writes

pytestmark = pytest.mark.integration

PREFIX = "/etcd-elastic-test"
ROUND = 1

# Every call of the Store that goes to etcd, as a caller makes it.
CALLS: dict[str, Callable[[EtcdStore], object]] = {
    "set": lambda s: s.set("k", "v"),
    "get": lambda s: s.get("absent"),
    "add": lambda s: s.add("counter", 1),
    "append": lambda s: s.append("log", "x"),
    "compare_set": lambda s: s.compare_set("k", "", "v"),
    "multi_set": lambda s: s.multi_set(["a", "b"], ["1", "2"]),
    "multi_get": lambda s: s.multi_get(["a"]),
    "wait": lambda s: s.wait(["absent"]),
    "check": lambda s: s.check(["k"]),
    "num_keys": lambda s: s.num_keys(),
    "list_keys": lambda s: s.list_keys(),
    "delete_key": lambda s: s.delete_key("k"),
}
WRITES = ("set", "add", "append", "compare_set", "multi_set", "delete_key")


@pytest.fixture
def own_etcd() -> Iterator[EtcdCluster]:
    """A single member of this test's own: it is stopped, or gets auth enabled."""
    with EtcdCluster(1, no_fsync=True, stop_grace=1.0) as cluster:
        yield cluster


def _store(client: EtcdClient, run_id: str) -> EtcdStore:
    return EtcdStore(client, RunKeys(PREFIX, run_id).store_prefix(ROUND), timedelta(seconds=30))


@pytest.mark.parametrize("call", sorted(CALLS))
def test_an_etcd_outage_reaches_the_store_caller_as_torch_store_error(
    own_etcd: EtcdCluster, run_id: str, call: str
) -> None:
    config = EtcdConfig(tuple(own_etcd.endpoints), request_timeout=0.5, retry_budget=1.0)
    with EtcdClient(config) as client:
        store = _store(client, run_id)
        store.set("k", "v")  # the round's store works...
        own_etcd.kill(0)  # ... then etcd goes away
        with pytest.raises(DistStoreError) as info:
            CALLS[call](store)
    error = info.value
    # What TCPStore raises when its server is gone, and what the store's callers catch;
    # still the core's error for code that catches ours.
    assert isinstance(error, DistNetworkError)
    assert isinstance(error, core.EtcdConnectionError)
    assert str(error).startswith("no etcd member answered "), str(error)
    assert str(error).endswith("Check that etcd runs and is reachable at these endpoints")


def test_a_user_who_may_not_write_the_store_gets_torch_store_errors(
    own_etcd: EtcdCluster, run_id: str
) -> None:
    run_prefix = RunKeys(PREFIX, run_id).run_prefix.decode()
    password = uuid.uuid4().hex
    endpoint = own_etcd.endpoints[0]
    enable_auth(
        endpoint,
        uuid.uuid4().hex,
        {"trainer": (password, run_grants_without_store_writes(run_prefix))},
    )
    config = EtcdConfig((endpoint,), user="trainer", password=password, retry_budget=5.0)
    with EtcdClient(config) as client:
        client.put(RunKeys(PREFIX, run_id).state, b"")  # the rest of the run is writable
        store = _store(client, run_id)
        assert store.num_keys() == 0  # reads are allowed
        for call in WRITES:
            with pytest.raises(DistStoreError) as info:
                CALLS[call](store)
            error = info.value
            assert isinstance(error, core.EtcdAuthError), call
            assert "etcd user 'trainer' is not permitted to " in str(error), call
            assert str(error).endswith(
                "(etcdserver: permission denied); grant the user's role readwrite on the key prefix"
            ), call

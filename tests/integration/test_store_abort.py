"""``EtcdStore.abort``: the agent ends the waits of a round it no longer waits on.

A blocked ``get`` (and one on a clone) ends at once with a ``DistStoreError`` that says
why; later reads fail at once too; writes still work (they do not wait).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import DistStoreError

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore

pytestmark = pytest.mark.integration


def test_abort_ends_blocked_and_later_reads(etcd1: EtcdCluster, run_id: str) -> None:
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        store = EtcdStore(client, f"/t/{run_id}/store/1/".encode(), timedelta(seconds=60))
        clone = store.clone()
        errors: list[BaseException] = []

        def read(s: EtcdStore) -> None:
            try:
                s.get("never")
            except BaseException as exc:
                errors.append(exc)

        readers = [threading.Thread(target=read, args=(s,)) for s in (store, clone)]
        for reader in readers:
            reader.start()
        time.sleep(0.5)  # both are now blocked in their watch
        started = time.monotonic()
        store.abort("the membership changed")
        for reader in readers:
            reader.join(timeout=10)
        took = time.monotonic() - started
        assert not any(r.is_alive() for r in readers)
        assert took < 5, took
        assert [str(e) for e in errors] == [
            "wait for store keys 'never' aborted: the membership changed"
        ] * 2
        assert all(isinstance(e, DistStoreError) for e in errors)
        with pytest.raises(DistStoreError, match="aborted: the membership changed"):
            clone.wait(["other"])
        store.set("k", "v")  # writes still go through
        assert clone.check(["k"])

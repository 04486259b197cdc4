"""The Store on etcd itself: where keys live, clean-up of old rounds, messages, a
three-member cluster, compaction, torch's C++ side (gloo) and watches being cancelled."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import etcd3
import pytest
from torch.distributed import DistStoreError

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys, encode_store_key
from coordinator.core.store_rounds import delete_round, delete_rounds_before
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.store import EtcdStore
from tests.integration.store_support import (  # noqa: F401 (fixtures)
    LONG,
    ODD_KEYS,
    PROMPT_S,
    SHORT,
    Backend,
    Later,
    etcd_backend,
    etcd_fixture,
)

pytestmark = pytest.mark.integration


# -- etcd only: where keys live, cleanup --------------------------------------------------


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
    with etcd_backend(etcd3, run_id) as backend:
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

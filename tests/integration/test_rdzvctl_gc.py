"""``rdzvctl close`` and ``rdzvctl gc`` against real etcd: what they write, what they
never touch, and running agents that finish their attempt after a close."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import RunKeys
from coordinator.core.state import NodeInfo, decode_state, encode_node
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl.model import read_run
from coordinator.rdzvctl.ops import collect_run
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.e2e.agents import Agents
from tests.integration.rdzvctl_support import (
    HOUR_MS,
    ctl,
    ctl_json,
    form,
    handler,
    keys_under,
    rewrite_state,
)
from tests.rdzv_helpers import Joins, wait_until

pytestmark = pytest.mark.integration


# -- close ----------------------------------------------------------------------------


def test_close_ends_the_run_for_handlers_and_late_joiners(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 2) for _ in range(2)]
    form(handlers)
    code, out, err = ctl(capsys, etcd1, "close", run_id, "--reason", "maintenance window")
    assert (code, err) == (0, "")
    assert out == (
        f"run {run_id} closed (maintenance window): its agents finish their current attempt "
        "and exit 0; no node joins it again (once all have left, the same run id starts a "
        "new incarnation)\n"
    )
    wait_until(lambda: all(h.is_closed() for h in handlers), 10, "every handler to see it")
    # A node of the run that re-rendezvouses learns it is closed (a newcomer would wait
    # for these nodes to leave, then start the run again: test_run_lifecycle.py).
    with pytest.raises(RendezvousClosedError, match=r"is closed \(maintenance window\)"):
        handlers[0].next_rendezvous()
    data = ctl_json(capsys, etcd1, "close", run_id)
    assert data == {
        "run_id": run_id, "closed": True, "changed": False,
        "closed_reason": "maintenance window", "state_mod_revision": data["state_mod_revision"],
    }  # fmt: skip
    assert ctl(capsys, etcd1, "close", run_id)[1] == (
        f"run {run_id} was closed already (maintenance window)\n"
    )
    status = ctl_json(capsys, etcd1, "status", run_id)
    assert status["phase"] == "closed" and status["written_by"].startswith("rdzvctl@")


def test_close_of_a_missing_run_exits_1(
    etcd1: EtcdCluster, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = ctl(capsys, etcd1, "close", run_id)
    assert code == 1 and err.startswith(f"rdzvctl: error: run {run_id!r} not found")


@pytest.mark.e2e
@pytest.mark.slow
def test_close_lets_running_agents_finish_their_attempt_and_exit_0(
    etcd1: EtcdCluster, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    agents = Agents(run_id, etcd1.endpoint_list, tmp_path)
    report = tmp_path / "report.jsonl"
    try:
        procs = [
            agents.start(name, ["--nnodes=2", "--nproc-per-node=1", "--rdzv-conf=lease_ttl=3"],
                         ["--epochs", "2", "--steps-per-epoch", "10", "--sleep-per-step", "0.4",
                          "--report", str(report)])
            for name in ("a", "b")
        ]  # fmt: skip
        wait_until(lambda: report.exists() and len(report.read_text().splitlines()) == 2,
                   120, "both workers to start training")  # fmt: skip
        code, _, err = ctl(capsys, etcd1, "close", run_id, "--reason", "maintenance")
        assert code == 0, err
        closed_at = time.monotonic()
        codes = [p.wait(120) for p in procs]
        took = time.monotonic() - closed_at
        assert codes == [0, 0], agents.logs()
        # The attempt ran to its end (rank 0 says so), and nobody restarted.
        assert any("done: 2 epochs" in p.output() for p in procs), agents.logs()
        assert len(report.read_text().splitlines()) == 2 and took < 90
        status = ctl_json(capsys, etcd1, "status", run_id)
        assert status["closed_reason"] == "maintenance" and status["nodes"] == []
    finally:
        agents.reap()


# -- gc -------------------------------------------------------------------------------


def test_gc_dry_run_lists_and_gc_removes_only_what_it_should(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    prefix = f"/{run_id}"
    now_ms = int(time.time() * 1000)

    def run(name: str, n: int = 1) -> list[EtcdRendezvousHandler]:
        made = [handler(etcd1, name, n, n, prefix) for _ in range(n)]
        handlers.extend(made)
        infos = Joins(made).start().infos()
        infos[0].store.set("user/key", b"v")  # the run's torch Store holds something
        return made

    live = run("live", 2)  # nodes alive: never touched, whatever its age
    rewrite_state(client, RunKeys(prefix, "live"), completed_at_unix_ms=now_ms - 5 * HOUR_MS)
    old_closed = run("old-closed")
    old_closed[0].shutdown()
    rewrite_state(
        client,
        RunKeys(prefix, "old-closed"),
        completed_at_unix_ms=now_ms - 4 * HOUR_MS,
        closed_at_unix_ms=now_ms - 3 * HOUR_MS,
    )
    young_closed = run("young-closed")
    young_closed[0].shutdown()
    abandoned = run("abandoned")
    abandoned[0].leave()  # gone without closing: no node alive
    rewrite_state(client, RunKeys(prefix, "abandoned"), completed_at_unix_ms=now_ms - 2 * HOUR_MS)
    client.put(f"{prefix}/never/store/1/x".encode(), b"1")  # leftovers of a run that never formed
    client.put(f"{prefix}/foreign/thing".encode(), b"1")
    client.put(f"{prefix}/corrupt/state".encode(), b"garbage")
    assert live[0].is_closed() is False

    before = keys_under(client, prefix)
    plan = ctl_json(capsys, etcd1, "gc", "--older-than", "1h", "--dry-run", "--key-prefix", prefix)
    assert keys_under(client, prefix) == before  # a dry run writes nothing
    verdicts = {r["run_id"]: (r["collect"], r["reason"]) for r in plan["runs"]}
    assert {k: v for k, v in verdicts.items() if k not in ("corrupt", "foreign")} == {
        "abandoned": (True, "abandoned: no node alive, last round completed 2h ago"),
        "live": (False, "2 node(s) alive"),
        "never": (True, "never formed: no state and no node alive, no round ever completed"),
        "old-closed": (True, "closed (shutdown by an agent), it was closed 3h ago"),
        "young-closed": (False, verdicts["young-closed"][1]),
    }  # fmt: skip
    assert verdicts["corrupt"] == (
        False, "a value does not decode: inspect it with etcdctl and remove it by hand"
    )  # fmt: skip
    assert verdicts["foreign"] == (
        False, "only 1 foreign key(s), not written by etcd-elastic: remove them by hand"
    )  # fmt: skip
    assert verdicts["young-closed"][1].startswith(
        "closed (shutdown by an agent), but it was closed only "
    )
    code, out, _ = ctl(
        capsys, etcd1, "gc", "--older-than", "1h", "--dry-run", "--key-prefix", prefix
    )
    assert code == 0 and out.splitlines()[0] == "ACTION        RUN           KEYS  WHY"
    # Its state, its Store's key and its timeline (the round, which carries its member's
    # join, the close, the node leaving).
    assert "would remove  old-closed    5     closed (shutdown by an agent)" in out

    code, out, _ = ctl(capsys, etcd1, "gc", "--older-than", "1h", "--key-prefix", prefix)
    assert code == 0, out
    after = keys_under(client, prefix)
    removed = {k for k in before if k not in after}
    assert {k.split("/")[2] for k in removed} == {"abandoned", "never", "old-closed"}
    assert all(after[k] == v for k, v in before.items() if k not in removed)  # untouched
    assert [k for k in after if k.startswith(f"{prefix}/live/")] == [
        k for k in before if k.startswith(f"{prefix}/live/")
    ]
    assert "removed  old-closed" in out and "removed  never" in out
    # The live run still works: its nodes re-rendezvous into round 2.
    assert sorted(form(live).values()) == [0, 1]


def test_gc_spares_a_run_whose_node_joins_during_collection(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    prefix = f"/{run_id}"
    keys = RunKeys(prefix, "job")
    client.put(keys.store_key(1, "x"), b"1")
    snapshot = read_run(client, keys)  # no node yet: gc would take it...
    # ...but a node arrives before gc writes. A join puts its node key first and writes
    # the state only after; the node is caught between the two (a real handler would
    # race past that window in milliseconds, so its key is put here by hand).
    lease = client.lease_grant(30)
    try:
        record = NodeInfo(node_id="arriving", wanted_round=1, lease_id=lease)
        client.put(keys.node("arriving"), encode_node(record), lease=lease)
        result = collect_run(client, snapshot, written_by="test")
        assert (result.removed, result.message) == (
            False, "stopped: 1 node(s) joined while it was being removed; it is left closed"
        )  # fmt: skip
        assert client.get(keys.node("arriving"))[0] is not None  # node keys are never deleted
        assert client.get(keys.store_key(1, "x"))[0] is None  # the store went with the close
        # A node that joins now asks to start the run again, and waits while a node of
        # the closed run is alive.
        newcomer = handler(etcd1, "job", 1, 1, prefix)
        handlers.append(newcomer)
        joins = Joins([newcomer]).start()
        time.sleep(0.5)
        assert joins.outcomes == {}
    finally:
        client.lease_revoke(lease)
    assert joins.infos(30)[0].rank == 0
    kv = client.get(keys.state)[0]
    assert kv is not None and decode_state(keys.state.decode(), kv.value).incarnation == 2


def test_gc_that_races_a_joining_node_never_removes_its_run(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, handlers: list[EtcdRendezvousHandler]
) -> None:
    """The same race left to chance: whichever write lands first, the run is not removed
    and the node's key stays (either gc closed it first, or the node's state write made
    gc's guarded write fail)."""
    prefix = f"/{run_id}"
    keys = RunKeys(prefix, "job")
    client.put(keys.store_key(1, "x"), b"1")
    snapshot = read_run(client, keys)
    newcomer = handler(etcd1, "job", 2, 2, prefix)
    handlers.append(newcomer)
    Joins([newcomer]).start()
    wait_until(lambda: client.count_prefix(keys.nodes_prefix)[0] == 1, 10, "the node's key")
    result = collect_run(client, snapshot, written_by="test")
    assert result.removed is False
    assert result.message in (
        "stopped: 1 node(s) joined while it was being removed; it is left closed",
        "skipped: its state changed since it was read",
    )
    assert client.get(keys.node(newcomer.node_id))[0] is not None
    assert client.get(keys.state)[0] is not None

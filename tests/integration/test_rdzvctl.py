"""``rdzvctl`` against real etcd: runs built by real handlers (and real ``etcdrun`` agents
where it matters), every command, ``--json`` parsed, exit codes and one-line errors.

Commands run in-process through :func:`coordinator.rdzvctl.main` (exactly the console
script's code, without paying torch's import for every call); the console path itself
(exit codes seen by a shell, Ctrl-C) is checked with the installed ``rdzvctl`` script.
Tests that list runs use a key prefix of their own, so other tests' runs never show up.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import RunKeys
from coordinator.core.state import RdzvState, decode_state, encode_state
from coordinator.etcd_server import EtcdCluster, free_port
from coordinator.rdzvctl import main, run_command
from coordinator.rdzvctl.cli import parse_args
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler
from tests.e2e.agents import Agents
from tests.rdzv_helpers import Joins, shutdown_all, wait_until

pytestmark = pytest.mark.integration

RDZVCTL = Path(sys.executable).parent / "rdzvctl"
HOUR_MS = 3_600_000


@pytest.fixture
def handlers() -> Iterator[list[EtcdRendezvousHandler]]:
    """Handlers a test creates; all leave at the end, even on failure."""
    made: list[EtcdRendezvousHandler] = []
    yield made
    shutdown_all(made)


@pytest.fixture
def client(etcd1: EtcdCluster) -> Iterator[EtcdClient]:
    with EtcdClient(EtcdConfig(tuple(etcd1.endpoints))) as c:
        yield c


def handler(
    etcd: EtcdCluster, run_id: str, min_nodes: int, max_nodes: int, prefix: str = "/etcd-elastic"
) -> EtcdRendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3", etcd.endpoint_list, run_id, min_nodes, max_nodes,
        last_call_timeout=0.5, join_timeout=60, lease_ttl=3, key_prefix=prefix,
    )  # fmt: skip
    return create_handler(params, local_world_size=2, role="trainer")


def ctl(capsys: pytest.CaptureFixture[str], etcd: EtcdCluster, *argv: str) -> tuple[int, str, str]:
    """Run ``rdzvctl <argv> --endpoints=<etcd>`` in-process: (exit code, stdout, stderr)."""
    code = main([*argv, f"--endpoints={etcd.endpoint_list}"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ctl_json(capsys: pytest.CaptureFixture[str], etcd: EtcdCluster, *argv: str) -> Any:
    code, out, err = ctl(capsys, etcd, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def form(hs: list[EtcdRendezvousHandler]) -> dict[str, int]:
    """next_rendezvous() on every handler; returns node id -> group rank."""
    infos = Joins(hs).start().infos()
    return {hs[i].node_id: info.rank for i, info in infos.items()}


def keys_under(client: EtcdClient, prefix: str) -> dict[str, int]:
    """Every key under ``prefix`` with its mod_revision."""
    kvs, _ = client.get_prefix(prefix.encode())
    return {kv.key.decode(): kv.mod_revision for kv in kvs}


def rewrite_state(client: EtcdClient, keys: RunKeys, **changes: Any) -> None:
    """Change fields of a run's state (CAS), e.g. to make it look hours old."""
    kv, _ = client.get(keys.state)
    assert kv is not None
    state = decode_state("state", kv.value)
    new = RdzvState(**{**state.__dict__, **changes})
    assert client.put_if_mod_revision(keys.state, encode_state(new), kv.mod_revision).succeeded


# -- status ---------------------------------------------------------------------------


def test_status_shows_round_ranks_hosts_leases_and_lists(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 4) for _ in range(3)]
    ranks = form(handlers)
    data = ctl_json(capsys, etcd1, "status", run_id)
    assert (data["phase"], data["round"], data["closed"]) == ("complete", 1, False)
    assert {p["node_id"]: p["rank"] for p in data["participants"]} == ranks
    for p in data["participants"]:
        assert p["alive"] and p["pid"] == os.getpid() and p["local_world_size"] == 2
        assert p["hostname"] and p["addr"] and p["wanted_round"] == 1
        assert 0 < p["lease_ttl_left"] <= 3
    assert data["wait_list"] == data["redundancy_list"] == data["lost"] == []

    # A newcomer waits; a participant that leaves is recorded as lost.
    late = handler(etcd1, run_id, 2, 4)
    handlers.append(late)
    waiting = Joins([late]).start()
    wait_until(lambda: handlers[0].num_nodes_waiting() == 1, 10, "the newcomer on the wait list")
    handlers[2].leave()
    wait_until(lambda: handlers[0].num_nodes_waiting() == 2, 10, "the leaver recorded as lost")
    data = ctl_json(capsys, etcd1, "status", run_id)
    assert data["wait_list"] == [late.node_id] and data["lost"] == [handlers[2].node_id]
    gone = next(p for p in data["participants"] if p["node_id"] == handlers[2].node_id)
    assert gone == {"rank": ranks[handlers[2].node_id], "node_id": gone["node_id"], "alive": False}
    assert {n["node_id"]: n["status"] for n in data["nodes"]}[late.node_id] == "waiting"

    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert code == 0 and err == ""
    assert "state:           complete, round 1 completed " in out
    assert f"wait list:       {late.node_id}\n" in out
    assert f"lost:            {handlers[2].node_id}\n" in out
    assert "nodes alive:     3\n" in out
    # The survivors re-rendezvous with the newcomer: round 2 has three nodes.
    round2 = Joins(handlers[:2]).start()
    round2.infos()
    waiting.infos()
    data = ctl_json(capsys, etcd1, "status", run_id)
    assert data["round"] == 2 and len(data["participants"]) == 3 and data["lost"] == []


def test_status_of_a_missing_run_exits_1(
    etcd1: EtcdCluster, run_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert (code, out) == (1, "")
    assert err == (
        f"rdzvctl: error: run {run_id!r} not found: no key starts with /etcd-elastic/{run_id}/; "
        "see 'rdzvctl list' for the runs there are\n"
    )


def test_status_of_a_corrupt_state_names_the_key_and_exits_1(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = RunKeys("/etcd-elastic", run_id)
    client.put(keys.state, b"\x80\x04pickle")
    code, out, err = ctl(capsys, etcd1, "status", run_id)
    assert code == 1
    assert "state:           unreadable (see the error below)" in out
    assert err == (
        f"rdzvctl: error: corrupt value at etcd key '/etcd-elastic/{run_id}/state': not a "
        "RendezvousState in JSON ('utf-8' codec can't decode byte 0x80 in position 0: "
        "invalid start byte)\n"
    )


# -- list -----------------------------------------------------------------------------


def test_list_shows_every_run_and_goes_on_past_a_corrupt_one(
    etcd1: EtcdCluster, run_id: str, client: EtcdClient,
    handlers: list[EtcdRendezvousHandler], capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    prefix = f"/{run_id}"
    handlers += [handler(etcd1, "live", 2, 2, prefix) for _ in range(2)]
    form(handlers)
    finished = [handler(etcd1, "finished", 1, 1, prefix)]
    form(finished)
    finished[0].shutdown()  # closes the run, as torchrun does at the end
    client.put(f"{prefix}/broken/state".encode(), b"{not json")
    client.put(f"{prefix}/stray".encode(), b"x")

    code, out, err = ctl(capsys, etcd1, "list", "--key-prefix", prefix)
    assert code == 0
    assert out.splitlines() == [
        "RUN       PHASE       ROUND  PARTICIPANTS  ALIVE  WAITING  LOST  CLOSED",
        "broken    unreadable  0      0             0      0        0     no",
        "finished  closed      1      1             0      0        0     "
        "yes: shutdown by an agent",
        "live      complete    1      2             2      0        0     no",
    ]
    assert err.splitlines()[0].startswith(
        f"rdzvctl: warning: corrupt value at etcd key '{prefix}/broken/state': not a "
        "RendezvousState in JSON"
    )
    assert err.splitlines()[1] == (
        f"rdzvctl: warning: key '{prefix}/stray' is not part of any run "
        "(not written by etcd-elastic)"
    )
    data = ctl_json(capsys, etcd1, "list", "--key-prefix", prefix)
    assert [(r["run_id"], r["phase"], r["alive"]) for r in data["runs"]] == [
        ("broken", "unreadable", 0), ("finished", "closed", 0), ("live", "complete", 2),
    ]  # fmt: skip
    assert data["runs"][0]["errors"] and data["foreign_keys"] == [f"{prefix}/stray"]
    assert ctl(capsys, etcd1, "list", "--key-prefix", f"{prefix}-none")[1] == (
        f"no runs under {prefix}-none/\n"
    )


# -- watch ----------------------------------------------------------------------------


def _watch_in_thread(
    etcd: EtcdCluster, argv: list[str]
) -> tuple[threading.Thread, io.StringIO, io.StringIO, list[int]]:
    opts = parse_args([*argv, f"--endpoints={etcd.endpoint_list}"], environ={})
    out, err, code = io.StringIO(), io.StringIO(), []
    thread = threading.Thread(target=lambda: code.append(run_command(opts, out, err)))
    thread.start()
    wait_until(lambda: "watching run" in err.getvalue(), 20, "the watch to start")
    return thread, out, err, code


def test_watch_prints_one_line_per_change_as_it_happens(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    thread, out, err, code = _watch_in_thread(etcd1, ["watch", run_id, "--count", "4",
                                                      "--timeout", "60"])  # fmt: skip
    handlers += [handler(etcd1, run_id, 2, 2) for _ in range(2)]
    ranks = form(handlers)
    in_rank_order = " ".join(sorted(ranks, key=ranks.__getitem__))
    handlers[0].set_closed("maintenance")
    thread.join(60)
    assert not thread.is_alive() and code == [0], err.getvalue()
    lines = [line.split(" ", 1) for line in out.getvalue().splitlines()]
    assert all(len(t) == 8 and t[2] == t[5] == ":" for t, _ in lines), lines
    texts = [text for _, text in lines]
    assert sorted(texts[:2]) == sorted(
        f"node {h.node_id} joined (asks for round 1)" for h in handlers
    )
    assert texts[2:] == [f"round 1 complete: 2 nodes [{in_rank_order}]", "run closed (maintenance)"]
    assert err.getvalue() == (
        f"rdzvctl: watching run {run_id} from etcd revision "
        f"{err.getvalue().split('revision ')[1].split(':')[0]}: empty, round 0, 0 node(s) alive "
        "(no key yet); Ctrl-C to stop\n"
    )


def test_watch_json_lines_and_timeout(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [handler(etcd1, run_id, 2, 2) for _ in range(2)]
    form(handlers)
    thread, out, _err, code = _watch_in_thread(etcd1, ["watch", run_id, "--json", "--timeout",
                                                       "3"])  # fmt: skip
    handlers[1].leave()  # the survivor's coordinator records it as lost
    started = time.monotonic()
    thread.join(30)
    assert code == [0] and time.monotonic() - started < 20
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(e["event"], e.get("node_id")) for e in events] == [
        ("node_left", handlers[1].node_id),
        ("lost", handlers[1].node_id),
    ]
    assert all(e["run_id"] == run_id and e["revision"] > 0 for e in events)


def test_watch_ends_with_exit_0_on_ctrl_c(etcd1: EtcdCluster, run_id: str) -> None:
    proc = subprocess.Popen(
        [str(RDZVCTL), "watch", run_id, f"--endpoints={etcd1.endpoint_list}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        header = proc.stderr.readline()  # blocks until the watch is running
        assert header.startswith(f"rdzvctl: watching run {run_id} from etcd revision ")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
        assert code == 0, proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


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
        "and exit 0; nobody may join again\n"
    )
    wait_until(lambda: all(h.is_closed() for h in handlers), 10, "every handler to see it")
    late = handler(etcd1, run_id, 2, 2)
    handlers.append(late)
    with pytest.raises(RendezvousClosedError, match=r"is closed \(maintenance window\)"):
        late.next_rendezvous()
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
    assert "would remove  old-closed    2     closed (shutdown by an agent)" in out

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
    from coordinator.rdzvctl.model import read_run
    from coordinator.rdzvctl.ops import collect_run

    prefix = f"/{run_id}"
    keys = RunKeys(prefix, "job")
    client.put(keys.store_key(1, "x"), b"1")
    snapshot = read_run(client, keys)  # no node yet: gc would take it...
    newcomer = handler(etcd1, "job", 2, 2, prefix)
    handlers.append(newcomer)
    joining = Joins([newcomer]).start()  # ...but a node arrives before gc writes
    wait_until(lambda: client.count_prefix(keys.nodes_prefix)[0] == 1, 10, "the node's key")
    result = collect_run(client, snapshot, written_by="test")
    assert (result.removed, result.message) == (
        False, "stopped: 1 node(s) joined while it was being removed; it is left closed"
    )  # fmt: skip
    assert client.get(keys.node(newcomer.node_id))[0] is not None  # node keys are never deleted
    # The node learns at once that the run is closed, with gc's reason.
    error = joining.wait(30)[0].error
    assert isinstance(error, RendezvousClosedError)
    assert "garbage-collected by rdzvctl gc" in str(error)


# -- console path: exit codes 2 and 3 ------------------------------------------------


def test_console_bad_argument_is_one_line_and_exit_2() -> None:
    done = subprocess.run(
        [str(RDZVCTL), "status", "bad/id"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "rdzvctl: error: RUN: 'bad/id' is invalid: use 1-128 characters from A-Z a-z 0-9 . _ - "
        "starting with a letter or digit\n"
    )


def test_unreachable_etcd_exits_3_naming_the_endpoints() -> None:
    endpoints = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    started = time.monotonic()
    done = subprocess.run(
        [str(RDZVCTL), "status", "job", f"--endpoints={endpoints}", "--read-timeout=1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1
    first, second = endpoints.split(",")
    assert done.stderr.startswith("rdzvctl: error: no etcd member answered get within 1 s; tried ")
    assert first in done.stderr and second in done.stderr
    assert "Check that etcd runs and is reachable at these endpoints" in done.stderr
    assert time.monotonic() - started < 60

"""The run's timeline with real agents and workers: three agents, a worker failure (a
counted restart), a node SIGKILLed (its lease expires), a node drained with ``rdzvctl
drain``; then ``rdzvctl events`` lists all of it in order with the causes, and ``rdzvctl
timeline`` draws it.

``ETCD_ELASTIC_TIMELINE_OUT=docs/timeline.png`` also keeps the picture
(``scripts/timeline_demo`` draws the picture in docs/timeline.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.keys import DEFAULT_KEY_PREFIX, RunKeys
from coordinator.core.state import RdzvState, decode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl import main as rdzvctl
from tests.e2e.agents import AgentProc, Agents, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

TTL = 2
JOB = 120.0
FAILING_RANK = 2


def _state(client: EtcdClient, keys: RunKeys) -> RdzvState:
    kv, _ = client.get(keys.state)
    return RdzvState() if kv is None else decode_state(keys.state.decode(), kv.value)


def _events(capsys: pytest.CaptureFixture[str], etcd: EtcdCluster, run_id: str) -> list[Any]:
    code = rdzvctl(["events", run_id, "--json", f"--endpoints={etcd.endpoint_list}"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_rdzvctl_events_lists_a_failure_a_node_loss_and_a_drain_in_order(
    agents: Agents, etcd1: EtcdCluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "report.jsonl"
    script = [
        "--epochs", "16", "--steps-per-epoch", "2", "--sleep-per-step", "0.2",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--report", str(report),
        "--fail-once-at-epoch", "1", "--fail-rank", str(FAILING_RANK),
    ]  # fmt: skip
    # last_call_timeout: the three agents, started at once, form round 1 together even on
    # a loaded machine; later rounds complete as soon as every survivor is back.
    flags = [
        "--nnodes=1:3", "--nproc-per-node=1", "--max-restarts=3", "--shutdown-timeout=5",
        f"--rdzv-conf=lease_ttl={TTL},last_call_timeout=8",
    ]  # fmt: skip
    keys = RunKeys(DEFAULT_KEY_PREFIX, agents.run_id)
    started = time.monotonic()

    def say(text: str) -> None:
        with capsys.disabled():
            print(text)

    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        procs = [agents.start(name, flags, script) for name in "abc"]

        def agent_of(node_id: str) -> AgentProc:
            return next(p for p in procs if f"-{p.pid}-" in node_id)

        # 1. Round 1 of three; rank 2's worker fails at epoch 1: a counted restart.
        wait_for(
            "a restart after the worker failure",
            lambda: any(r["restart_count"] == 1 for r in read_report(report)),
            JOB, diagnose=agents.logs,
        )  # fmt: skip
        wait_for(
            "three workers again", lambda: len(_state(client, keys).participants) == 3
            and _state(client, keys).round >= 2, JOB, diagnose=agents.logs,
        )  # fmt: skip
        after_failure = _state(client, keys)
        say(f"restarted after the failure at {time.monotonic() - started:.1f} s")
        rank0, victim, drained = (agent_of(n) for n in after_failure.participants)

        # 2. A node is lost: SIGKILL, nothing said; its lease expires after TTL.
        victim.kill_node()
        wait_for(
            "a round without the lost node",
            lambda: len(_state(client, keys).participants) == 2, JOB, diagnose=agents.logs,
        )  # fmt: skip

        # 3. An operator drains another node.
        drained_id = after_failure.participants[2]
        assert rdzvctl(["drain", agents.run_id, drained_id,
                        f"--endpoints={etcd1.endpoint_list}"]) == 0  # fmt: skip
        capsys.readouterr()
        say(f"drained at {time.monotonic() - started:.1f} s")
        assert drained.wait(JOB) == 0, agents.logs()
        assert rank0.wait(JOB) == 0, agents.logs()
    say(f"scenario ran in {time.monotonic() - started:.1f} s")

    events = _events(capsys, etcd1, agents.run_id)
    nodes = list(after_failure.participants)
    rounds = [e for e in events if e["kind"] == "round_completed"]
    failing_group_rank = next(
        r["group_rank"] for r in read_report(report)
        if r["rank"] == FAILING_RANK and r["restart_count"] == 0
    )  # fmt: skip
    failing_node = rounds[0]["members"][failing_group_rank]["node_id"]
    # The order of what happened. Restarts are checked apart: the others' workers may
    # also fail (a broken collective when a node goes) and count one, given back later.
    story = [
        (e["kind"], e["node_id"], e["cause"], len(e["members"]))
        for e in events
        if e["kind"] != "restarted" and not (e["kind"] == "departed" and e["cause"] == "left")
    ]
    joins = sorted(s for s in story[:3])
    assert joins == sorted(("joined", n, "", 0) for n in nodes), events
    assert story[3:8] == [
        ("round_completed", "", "", 3),
        ("round_completed", "", "", 3),
        ("departed", nodes[1], "lease_expired", 0),
        ("round_completed", "", "", 2),
        ("drain_requested", drained_id, "", 0),
    ], json.dumps(events, indent=1)
    # A node being drained counts as lost while its key lives (its workers stop first),
    # so the survivor's round without it and its departure (its key gone) race: either
    # may be written first, and both are true in either order (seen both ways once the
    # restarts got fast).
    assert sorted(story[8:10]) == [
        ("departed", drained_id, "drained", 0),
        ("round_completed", "", "", 1),
    ], json.dumps(events, indent=1)
    assert story[10:] == [("closed", "", "", 0)], json.dumps(events, indent=1)
    # The failure's restart comes between the first two rounds, with its root cause.
    first, second = rounds[0]["revision"], rounds[1]["revision"]
    between = [e for e in events if e["kind"] == "restarted" and first < e["revision"] < second]
    assert [e["node_id"] for e in between] == [failing_node], json.dumps(events, indent=1)
    restart = between[0]
    assert restart["summary"].startswith(f"rank {FAILING_RANK}: "), restart
    assert "exited with code 1" in restart["summary"], restart
    assert restart["restart_count"] == 1
    assert [m["node_id"] for m in rounds[-1]["members"]] == [nodes[0]]
    assert rounds[-2]["members"] == [
        {"node_id": nodes[0], "rank": 0}, {"node_id": drained_id, "rank": 1},
    ]  # fmt: skip
    closed = events[-1] if events[-1]["kind"] == "closed" else next(
        e for e in events if e["kind"] == "closed"
    )  # fmt: skip
    assert closed["close_mode"] == "finished", closed
    # Ordered by revision, whoever wrote them.
    assert [e["revision"] for e in events] == sorted(e["revision"] for e in events)

    # The same, as people read it.
    code = rdzvctl(["events", agents.run_id, f"--endpoints={etcd1.endpoint_list}"])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    text = out.splitlines()
    assert len(text) == len(events)
    assert any(f"{nodes[1]} departed: lease expired" in line for line in text), out
    assert any(f"{drained_id} departed: drained by an operator" in line for line in text), out
    say(out)

    picture = tmp_path / "timeline.png"
    code = rdzvctl(["timeline", agents.run_id, "-o", str(picture),
                    f"--endpoints={etcd1.endpoint_list}"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"wrote {picture}: 3 node(s), 4 round(s)"), out
    keep = os.environ.get("ETCD_ELASTIC_TIMELINE_OUT")
    if keep:
        shutil.copyfile(picture, keep)
    assert agents.leftovers() == []

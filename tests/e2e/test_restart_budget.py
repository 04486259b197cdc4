"""The job's restart budget end to end (issue 18, item 2): a node that leaves and joins
again cannot exceed ``--max-restarts``; and a node lost once the budget is used up still
costs nothing.

Two real agents, ``--max-restarts=1``. Node b's worker fails (the job's one restart);
b's agent is then killed and a fresh agent takes its place; when that agent's worker
fails, the job's budget is used up and the job ends: every agent exits 1, the one that
gave up with the root cause, the other with that node's line. Counted per node, as
torchrun does, the fresh agent would have started from a full budget and restarted.

The workers are a few lines of Python with no collective (no torch import, so the test
is light): a failure reaches the other node only as a membership change, never as a
worker failure of its own, so what decides the outcome is the budget's scope alone.
Each worker writes ``<name>.running.<round>`` (its node id, TORCHELASTIC_RESTART_COUNT)
and runs until the test writes ``<name>.fail`` (it exits 1) or ``release``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.e2e.agents import EXAMPLE, AgentProc, Agents, descendants, read_report, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

# Generous: two cores shared with other test runs; each agent imports torch.
STARTED = 240.0
JOB = 240.0

_WORKER = """\
import os, pathlib, sys, time

folder, name = pathlib.Path(sys.argv[1]), sys.argv[2]
round_no = os.environ["ETCD_ELASTIC_ROUND"]
(folder / f"{name}.running.{round_no}").write_text(
    os.environ["ETCD_ELASTIC_NODE_ID"] + " " + os.environ["TORCHELASTIC_RESTART_COUNT"]
)
fail = folder / f"{name}.fail"
deadline = time.monotonic() + 300  # never outlive a broken test by much
while not (folder / "release").exists():
    if fail.exists():
        fail.unlink()
        sys.exit(1)
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.05)
"""


def _rounds(folder: Path, name: str) -> dict[int, list[str]]:
    """round -> [node id, TORCHELASTIC_RESTART_COUNT] of ``name``'s workers so far."""
    out: dict[int, list[str]] = {}
    for path in folder.glob(f"{name}.running.*"):
        text = path.read_text().split()
        if len(text) == 2:  # written whole by now (two short fields in one write)
            out[int(path.name.rsplit(".", 1)[1])] = text
    return out


def _together(folder: Path, names: tuple[str, str], after: int = 0) -> int | None:
    """The newest round past ``after`` in which both nodes' workers run, if any."""
    common = set(_rounds(folder, names[0])) & set(_rounds(folder, names[1]))
    newer = [r for r in common if r > after]
    return max(newer) if newer else None


def test_a_node_leaving_and_joining_again_cannot_exceed_the_jobs_restart_budget(
    agents: Agents, tmp_path: Path
) -> None:
    folder = tmp_path / "marks"
    folder.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    conf = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=1", "--no-warm-start",
            "--rdzv-conf=lease_ttl=3"]  # fmt: skip

    def start(name: str) -> AgentProc:
        return agents.start(name, conf, [str(folder), name], script=worker)

    a, b = start("a"), start("b")
    wait_for("both workers running", lambda: _together(folder, ("a", "b")) is not None,
             STARTED, diagnose=agents.logs)  # fmt: skip
    first = _together(folder, ("a", "b"))
    assert first is not None

    # b's worker fails: the job's one restart. a's worker did not fail: a re-forms for
    # the membership change (b asking for the next round), yet its workers are told the
    # job's count, the same as b's.
    (folder / "b.fail").write_text("")
    wait_for("both workers running again", lambda: _together(folder, ("a", "b"), first),
             JOB, diagnose=agents.logs)  # fmt: skip
    second = _together(folder, ("a", "b"), first)
    assert second is not None
    counts = {n: _rounds(folder, n)[second][1] for n in "ab"}
    assert counts == {"a": "1", "b": "1"}, agents.logs()

    # b's agent is killed with its workers, and a fresh agent takes its place.
    b.kill_node()
    fresh = start("b2")
    wait_for("a and the fresh agent's workers running",
             lambda: _together(folder, ("a", "b2"), second), STARTED,
             diagnose=agents.logs)  # fmt: skip
    third = _together(folder, ("a", "b2"), second)
    assert third is not None
    assert _rounds(folder, "b2")[third][0] != _rounds(folder, "b")[second][0]  # another node
    assert {n: _rounds(folder, n)[third][1] for n in ("a", "b2")} == {"a": "1", "b2": "1"}

    # The fresh agent's worker fails: the job's budget is used up, the job ends.
    (folder / "b2.fail").write_text("")
    wait_for(
        "the job to end (or to restart past its budget)",
        lambda: (
            (a.proc.poll() is not None and fresh.proc.poll() is not None)
            or _together(folder, ("a", "b2"), third) is not None
        ),
        JOB,
        diagnose=agents.logs,
    )
    restarted = _together(folder, ("a", "b2"), third)
    assert restarted is None, f"round {restarted} formed past the job's budget\n{agents.logs()}"
    assert (a.wait(60), fresh.wait(60)) == (1, 1), agents.logs()

    # The fresh agent gave up with the root cause and closed the run with it ...
    report = fresh.output().split("Root cause (first failure):", 1)
    assert len(report) == 2, fresh.output()
    assert re.search(r"exit code  : 1\n", report[1]), report[1]
    assert "restarts left" not in fresh.output(), fresh.output()  # no counted restart of its own
    # ... which a, whose workers were running, reports in one line.
    lines = [x for x in a.output().splitlines() if x.startswith("etcdrun: error: ")]
    assert len(lines) == 1, a.output()
    assert re.fullmatch(
        rf"etcdrun: error: run '{agents.run_id}' is closed \(node \d \(.+\) gave up after 1 "
        r"restart: rank \d failed: exited with code 1, pid \d+.*\): it admits no more nodes; "
        r"start the job again \(same --rdzv-id\) once every node of this run has left",
        lines[0],
    ), lines[0]
    assert agents.leftovers() == []


def test_a_node_lost_with_no_restart_left_costs_nothing(agents: Agents, tmp_path: Path) -> None:
    """--max-restarts=0, two agents of examples/train_ddp.py (gloo): b is SIGKILLed. a's
    worker fails on the broken collective within seconds, while b's lease ends only a TTL
    (10 s here, so the order is sure) later; a waits for that departure instead of giving
    up, then trains on alone, not counted. Without the wait a would exit 1."""
    report = tmp_path / "report.jsonl"
    conf = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=0", "--no-warm-start",
            "--rdzv-conf=lease_ttl=10,last_call_timeout=10"]  # fmt: skip
    script = ["--epochs", "30", "--steps-per-epoch", "5", "--sleep-per-step", "0.1",
              "--checkpoint-dir", str(tmp_path / "ckpt"), "--report", str(report)]  # fmt: skip
    a = agents.start("a", conf, script, script=EXAMPLE)
    b = agents.start("b", conf, script, script=EXAMPLE)

    def world(size: int, after: float = 0.0) -> list[dict[str, object]]:
        return [r for r in read_report(report) if r["world_size"] == size and r["time"] > after]

    wait_for("a world of 2", lambda: len(world(2)) == 2, STARTED, diagnose=agents.logs)
    rank1 = next(r["pid"] for r in world(2) if r["rank"] == 1)
    victim, survivor = (b, a) if rank1 in descendants(b.pid) else (a, b)
    killed_at = time.time()
    victim.kill_node()
    wait_for(
        "the survivor training alone (or giving up)",
        lambda: len(world(1, killed_at)) == 1 or survivor.proc.poll() is not None,
        JOB,
        diagnose=agents.logs,
    )
    assert survivor.wait(JOB) == 0, agents.logs()
    assert [r["restart_count"] for r in world(1, killed_at)] == [0]
    out = survivor.output()
    assert "workers of round 1 failed with no restart left; waiting up to 11 s" in out, out
    assert re.search(r": \S+ left round 1: the failure is put down to that departure", out), out
    assert "membership changed; restarting (not counted)" in out, out
    assert agents.leftovers() == []

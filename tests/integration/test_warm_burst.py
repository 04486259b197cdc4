"""Worker starts in a burst find a warm interpreter ready (issue 21: the
``recovery_bound`` violations of the 200-fault chaos runs).

A node cut off from etcd past its lease comes back just after the others re-formed
without it: each of them starts its workers twice within seconds, soon after the start
that ended the fault before. Three ways that burst used to spend the interpreters:

- with two interpreters per local rank, the first start of the burst took one and
  deferred the import replacing it; the second took the last, and its replacement only
  began then, so the third start waited for an import (seconds of CPU per worker on a
  busy node) or started cold;
- refilled at once in a burst, every start still cost an import somewhere, and on two
  cores a chain of starts waited for the imports of the starts before it (the 3-agent
  chaos run of 26 November);
- the round formed without the node is abandoned when it comes back, often while its
  start still waits for one local rank's import: the ranks that had an interpreter ready
  took it for workers stopped at once, and the round with the node, seconds later,
  waited for their imports again.

The pool now replaces what a start took by forking an interpreter that is still ready:
no import, whenever the start came. The imports here are real interpreters whose
preload sleeps ``IMPORT_S`` seconds (no CPU, so the test's timing does not depend on the
machine's load): an interpreter ready sooner than that after a refill is a fork. A warm
start is proven by the started pid being one of the pool's ready interpreters, never by
timing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from agent.loop.warmup import refill_after_start
from agent.workers.group import build_argv
from agent.workers.launch import WorkerLaunch
from agent.workers.warm import ImportBounds, WarmPool
from tests.integration.warm_support import (
    READY_WITHIN,
    Harness,
    base_env,
    make_launch,
    wait_ready,
    warm_pids,
    write_probe,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


IMPORT_S = 6.0
SLEEPY = f"import time\ntime.sleep({IMPORT_S})\n"
# A sleeping import uses no CPU: never count it as stuck here.
BOUNDS = ImportBounds(overdue_idle_s=120.0, kill_idle_s=240.0, kill_s=280.0)
# The moments of the burst, after the first start of it (seconds): a formation, then the
# re-formation whose start is judged. An import begun at the formation is not done by
# then (its preload alone sleeps IMPORT_S); one begun at the first start is, with
# IMPORT_S + 3 - IMPORT_S = 3 s to spare for an interpreter's start on a loaded machine.
FORMATION_AT = 5.0
REFORMATION_AT = FORMATION_AT + IMPORT_S - 2.0
# A start from a ready interpreter is a handover over a socket: milliseconds.
WARM_START_WITHIN = 3.0


def _sleepy_pool(harness: Harness, tmp_path: Path) -> tuple[WarmPool, WorkerLaunch]:
    """A full pool of two for local rank 0 whose imports take ``IMPORT_S``."""
    write_probe(tmp_path)
    (tmp_path / "preload").mkdir()
    (tmp_path / "preload" / "sleepy.py").write_text(SLEEPY)
    env = base_env(PYTHONPATH=str(tmp_path / "preload"))
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]), env)
    pool = harness.pool(["sleepy"], depth=2, bounds=BOUNDS)
    pool.refill({0: (launch.argv, launch.env)})
    assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill"
    return pool, launch


def _pool_after_a_start(harness: Harness, tmp_path: Path) -> tuple[WarmPool, WorkerLaunch]:
    """A full sleepy pool, as after a worker start whose interpreter was replaced."""
    pool, launch = _sleepy_pool(harness, tmp_path)
    refill_after_start(pool, [launch])
    assert pool.ready_count(0) == 2
    return pool, launch


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


def test_a_reformation_right_after_a_formation_starts_warm(
    harness: Harness, tmp_path: Path
) -> None:
    pool, launch = _pool_after_a_start(harness, tmp_path)

    first = time.monotonic()
    group = harness.start([launch], pool=pool, cwd=tmp_path)  # the fault's first round
    refill_after_start(pool, [launch])
    assert harness.finish(group)[0].returncode == 0

    _sleep_until(first + FORMATION_AT)  # the others re-form without the node
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    refill_after_start(pool, [launch])
    assert harness.finish(group)[0].returncode == 0

    _sleep_until(first + REFORMATION_AT)  # ... and again with it, back
    held = warm_pids(pool, 0)
    assert pool.ready_count(0) >= 1, (
        "no interpreter ready for the re-formation: the import replacing the first start's "
        "began only at the formation"
    )
    began = time.monotonic()
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    took = time.monotonic() - began
    assert group.pids[0] in held, "the re-formation's worker did not start warm"
    assert took < WARM_START_WITHIN, f"the warm start took {took:.1f} s"
    assert harness.finish(group)[0].returncode == 0


def test_every_start_is_refilled_at_once_by_a_fork_not_an_import(
    harness: Harness, tmp_path: Path
) -> None:
    # Three starts back to back, each the moment the one before was refilled: every one
    # starts warm, and the pool is full again sooner than any import could be (each
    # preload sleeps IMPORT_S): the refills were forks.
    pool, launch = _pool_after_a_start(harness, tmp_path)
    for start in range(3):
        held = warm_pids(pool, 0)
        group = harness.start([launch], pool=pool, cwd=tmp_path)
        assert group.pids[0] in held, f"start {start} did not start warm"
        began = time.monotonic()
        refill_after_start(pool, [launch])
        assert pool.wait_ready(IMPORT_S / 2, every=2), (
            f"start {start}: the pool was not full again within {IMPORT_S / 2:.0f} s"
        )
        assert time.monotonic() - began < IMPORT_S / 2
        fresh = [p for p in warm_pids(pool, 0) if p not in held]
        assert len(fresh) == 1 and fresh[0] != group.pids[0]
        assert harness.finish(group)[0].returncode == 0


# Local rank 1's import waits for the file RELEASE names (no CPU: BOUNDS never give it up);
# local rank 0's is done at once.
GATE = """
import os, time
if os.environ.get("LOCAL_RANK") == "1":
    while not os.path.exists(os.environ["RELEASE"]):
        time.sleep(0.02)
"""


def test_an_abandoned_formation_leaves_the_ready_interpreters_to_the_reformation(
    harness: Harness, tmp_path: Path
) -> None:
    write_probe(tmp_path)
    (tmp_path / "preload").mkdir()
    (tmp_path / "preload" / "gate.py").write_text(GATE)
    release = tmp_path / "release"
    env = base_env(PYTHONPATH=str(tmp_path / "preload"), RELEASE=str(release))
    argv = build_argv("src/probe.py", ["exit:0"])
    launches = [make_launch(tmp_path / "runs" / "w", lr, argv, env) for lr in (0, 1)]
    pool = harness.pool(["gate"], depth=1, bounds=BOUNDS)
    try:
        pool.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches})
        deadline = time.monotonic() + READY_WITHIN
        while pool.ready_count(0) < 1:
            assert time.monotonic() < deadline, "local rank 0's interpreter was never ready"
            time.sleep(0.02)
        [ready0] = warm_pids(pool, 0)
        assert pool.ready_count(1) == 0  # local rank 1 still imports

        # The formation's start waits for local rank 1; the node comes back meanwhile and
        # the loop is woken: that round is over before its workers trained.
        back = threading.Event()

        def node_back() -> None:  # what the agent's wake() does
            back.set()
            pool.poke()

        timer = threading.Timer(1.0, node_back)
        timer.start()
        abandoned = harness.start(launches, pool=pool, cwd=tmp_path, interrupted=back)
        timer.join()
        assert ready0 not in abandoned.pids.values()
        assert pool.ready_count(0) == 1 and warm_pids(pool, 0) == [ready0], (
            "the abandoned round spent local rank 0's ready interpreter"
        )
        abandoned.stop(grace=1.0)

        # The re-formation, with the node back: both workers start warm, local rank 0's
        # from the interpreter the abandoned round left.
        release.write_text("")
        wait_ready(pool, [0, 1])
        held = {lr: warm_pids(pool, lr) for lr in (0, 1)}
        began = time.monotonic()
        group = harness.start(launches, pool=pool, cwd=tmp_path)
        took = time.monotonic() - began
        assert group.pids[0] == ready0
        assert [group.pids[1]] == held[1], "local rank 1 did not start warm"
        assert took < WARM_START_WITHIN, f"the warm start took {took:.1f} s"
        assert {lr: r.returncode for lr, r in harness.finish(group).items()} == {0: 0, 1: 0}
    finally:
        release.write_text("")

"""Warm starts that fall back to a cold start, and the pool's own processes: a launch a
ready interpreter does not fit (no Python, another environment, interpreter or flags,
streams to the console), no interpreter for the rank, a disabled pool, one still
importing (waited for, unless the start is interrupted), one killed while idle, a preload
that fails; a refill after a take, and ``close`` reaping every process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.workers.group import WorkerGroup, build_argv
from agent.workers.launch import WorkerLaunch, WorkerRanks
from agent.workers.logs import StreamPlan, WorkerLogs
from agent.workers.warm import WarmPool
from tests.integration.warm_support import (
    PY,
    Harness,
    alive,
    base_env,
    make_launch,
    pool_still_importing,
    started_cold,
    wait_gone,
    wait_ready,
    warm_pids,
    worker_env_of,
    write_probe,
)

# -- fallbacks: cold ----------------------------------------------------------------------


def _ready_pool(harness: Harness, tmp_path: Path, modules: Sequence[str] = ()) -> tuple[
    WarmPool, WorkerLaunch, list[int]
]:  # fmt: skip
    """A pool with a ready process for local rank 0, fit for the probe's launch."""
    write_probe(tmp_path)
    launch = make_launch(tmp_path / "runs" / "warm", 0, build_argv("src/probe.py", ["exit:0"]),
                         base_env())  # fmt: skip
    pool = harness.pool(modules)
    pool.refill({0: (launch.argv, launch.env)})
    wait_ready(pool, [0])
    return pool, launch, warm_pids(pool, 0)


def test_no_python_starts_cold_and_leaves_the_warm_process_ready(
    harness: Harness, tmp_path: Path
) -> None:
    pool, _, warm = _ready_pool(harness, tmp_path)
    script = str(tmp_path / "src" / "probe.py")
    other = make_launch(tmp_path / "runs" / "np", 0, build_argv(PY, [script, "exit:0"],
                        no_python=True), base_env())  # fmt: skip
    run = started_cold(harness, pool, other, warm, tmp_path)
    assert run.returncode == 0 and run.record["orig_argv"] == [PY, script, "exit:0"]
    assert warm_pids(pool, 0) == warm and pool.ready_count(0) == 1
    assert all(alive(pid) for pid in warm)


@pytest.mark.parametrize(
    "change",
    [{"OMP_NUM_THREADS": "2"}, {"MY_SETTING": "1"}, {"PYTHONHASHSEED": "7"}],
    ids=["OMP_NUM_THREADS", "a user variable", "PYTHONHASHSEED"],
)
def test_other_environment_starts_cold_and_leaves_the_warm_process_ready(
    harness: Harness, tmp_path: Path, change: dict[str, str]
) -> None:
    pool, launch, warm = _ready_pool(harness, tmp_path)
    other = WorkerLaunch(launch.ranks, launch.argv, {**launch.env, **change}, launch.logs)
    run = started_cold(harness, pool, other, warm, tmp_path)
    assert run.returncode == 0
    for key, value in change.items():
        assert run.record["env"][key] == value
    assert warm_pids(pool, 0) == warm and pool.ready_count(0) == 1


@pytest.mark.parametrize("other", ["flags", "interpreter"])
def test_other_interpreter_or_flags_start_cold(
    harness: Harness, tmp_path: Path, other: str
) -> None:
    pool, launch, warm = _ready_pool(harness, tmp_path)
    if other == "flags":
        argv = [PY, "-u", "-X", "utf8", "src/probe.py", "exit:0"]
    else:  # another python (here the base interpreter behind the venv's, by a symlink)
        (tmp_path / "bin").mkdir()
        python = tmp_path / "bin" / "python3"
        python.symlink_to(os.path.realpath(PY))
        argv = [str(python), "-u", "src/probe.py", "exit:0"]
    run = started_cold(harness, pool, WorkerLaunch(launch.ranks, argv, launch.env, launch.logs),
                        warm, tmp_path)  # fmt: skip
    assert run.returncode == 0 and run.record["orig_argv"] == argv
    assert run.record["executable"] == argv[0]
    assert warm_pids(pool, 0) == warm


TALK = """
import sys
print("out from " + sys.argv[1], flush=True)
print("err from " + sys.argv[1], file=sys.stderr, flush=True)
"""


def test_console_and_discarded_streams_are_the_same(
    harness: Harness, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Console only: the worker writes on the agent's own descriptors; neither: nothing."""
    (tmp_path / "talk.py").write_text(TALK)
    pool = harness.pool()
    seen = {}
    for kind in ("cold", "warm"):
        launches = []
        for lr, console in ((0, True), (1, False)):
            argv = build_argv("talk.py", [f"{kind} {lr}"])
            logs = WorkerLogs(StreamPlan(None, console), StreamPlan(None, console), "", "")
            env = worker_env_of(base_env(), lr, "")
            launches.append(WorkerLaunch(WorkerRanks(lr, lr, lr, 4, 4), argv, env, logs))
        if kind == "warm":
            pool.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in launches})
            wait_ready(pool, [0, 1])
            ready = {lr: warm_pids(pool, lr) for lr in (0, 1)}
        group = harness.start(launches, pool=pool if kind == "warm" else None, cwd=tmp_path)
        if kind == "warm":
            assert {lr: [pid] for lr, pid in group.pids.items()} == ready
        assert {lr: r.returncode for lr, r in harness.finish(group).items()} == {0: 0, 1: 0}
        seen[kind] = capfd.readouterr()
    for kind in ("cold", "warm"):
        assert seen[kind].out == f"out from {kind} 0\n", kind
        assert seen[kind].err == f"err from {kind} 0\n", kind


def test_no_process_for_the_rank_starts_cold(harness: Harness, tmp_path: Path) -> None:
    pool, launch, warm = _ready_pool(harness, tmp_path)
    # Local rank 1 with an environment rank 0's process would fit: processes are per rank.
    other_rank = WorkerLaunch(WorkerRanks(1, 1, 1, 4, 4), launch.argv, launch.env, launch.logs)
    run = started_cold(harness, pool, other_rank, warm, tmp_path)
    assert run.returncode == 0
    assert warm_pids(pool, 0) == warm and pool.ready_count(0) == 1


def test_disabled_pool_starts_nothing_and_workers_start_cold(
    harness: Harness, tmp_path: Path
) -> None:
    write_probe(tmp_path)
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]),
                         base_env())  # fmt: skip
    pool = harness.pool(enabled=False)
    pool.refill({0: (launch.argv, launch.env)})
    assert not pool.enabled and warm_pids(pool, 0) == [] and pool.ready_count(0) == 0
    assert started_cold(harness, pool, launch, [], tmp_path).returncode == 0


def _start_within(
    harness: Harness, launch: WorkerLaunch, pool: WarmPool, cwd: Path, seconds: float, **kw: Any
) -> tuple[WorkerGroup | None, threading.Thread]:
    """Start the group in a thread; the group if its start returned within ``seconds``
    (else None: the caller must let the start finish and join the thread)."""
    box: list[WorkerGroup] = []
    thread = threading.Thread(
        target=lambda: box.append(harness.start([launch], pool=pool, cwd=cwd, **kw)), daemon=True
    )
    thread.start()
    thread.join(seconds)
    return (box[0] if box else None), thread


def test_a_start_waits_for_its_interpreter_still_importing(
    harness: Harness, tmp_path: Path
) -> None:
    """By design (docs/warm-start.md): an interpreter still importing was started before
    the worker was asked for, so it is ahead of any cold start on the same cores; the
    start waits for it (bounded; an interruption ends the wait: the next test)."""
    pool, launch, release = pool_still_importing(harness, tmp_path)
    warm = warm_pids(pool, 0)
    timer = threading.Timer(1.0, lambda: release.write_text(""))
    timer.start()
    started = time.monotonic()
    group, thread = _start_within(harness, launch, pool, tmp_path, 30.0)
    try:
        assert group is not None, "the start did not end once its interpreter was ready"
        assert time.monotonic() - started >= 0.9  # it waited...
        assert group.pids[0] in warm  # ...for the importing interpreter, not a cold one
        assert harness.finish(group)[0].returncode == 0
    finally:
        timer.cancel()
        release.write_text("")
        thread.join(60)


def test_interrupted_start_does_not_wait_for_an_importing_process(
    harness: Harness, tmp_path: Path
) -> None:
    pool, launch, release = pool_still_importing(harness, tmp_path)
    warm = warm_pids(pool, 0)
    interrupted = threading.Event()
    interrupted.set()
    group, thread = _start_within(harness, launch, pool, tmp_path, 10.0, interrupted=interrupted)
    try:
        assert group is not None, "the start waited for a warm interpreter still importing"
        assert group.pids[0] not in warm
        assert harness.finish(group)[0].returncode == 0
        assert pool.ready_count(0) == 0 and warm_pids(pool, 0) == warm  # still importing
    finally:
        release.write_text("")
        thread.join(60)


def test_warm_process_killed_while_idle_starts_cold_with_one_warning(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool, launch, warm = _ready_pool(harness, tmp_path)
    os.kill(warm[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(warm[0]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with caplog.at_level(logging.WARNING, logger="agent"):
        run = started_cold(harness, pool, launch, warm, tmp_path)
    assert run.returncode == 0
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("agent.workers.warm", logging.WARNING,
         "warm start: local rank 0: the warm interpreter did not take the worker "
         "(error [Errno 32] Broken pipe); starting it cold"),
    ]  # fmt: skip
    assert wait_gone(warm[0]), "the killed warm process was not reaped"
    assert warm_pids(pool, 0) == []


def test_preload_failure_turns_warm_starts_off(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_probe(tmp_path)
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]),
                         base_env())  # fmt: skip
    pool = harness.pool(["no_such_module_for_warm_tests"])
    with caplog.at_level(logging.INFO, logger="agent.workers.warm"):
        pool.refill({0: (launch.argv, launch.env)})
        pid = warm_pids(pool, 0)[0]
        deadline = time.monotonic() + 60
        # The pool turns itself off on its own thread, then says so: wait for both.
        while pool.enabled or not caplog.records:
            assert time.monotonic() < deadline, "the failed preload was not noticed"
            time.sleep(0.02)
        assert wait_gone(pid)
    assert [r.getMessage() for r in caplog.records] == [
        "warm start: off for this agent, workers start cold (import "
        "no_such_module_for_warm_tests: ModuleNotFoundError: No module named "
        "'no_such_module_for_warm_tests')"
    ]
    assert started_cold(harness, pool, launch, [pid], tmp_path).returncode == 0
    pool.refill({0: (launch.argv, launch.env)})
    assert warm_pids(pool, 0) == []


# -- the pool's own processes --------------------------------------------------------------


def test_refill_after_take_starts_a_new_process_and_keeps_a_fitting_one(
    harness: Harness, tmp_path: Path
) -> None:
    pool, launch, warm = _ready_pool(harness, tmp_path)
    pool.refill({0: (launch.argv, {**launch.env, "RANK": "5"})})  # fits: nothing new
    assert warm_pids(pool, 0) == warm
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    assert [group.pids[0]] == warm
    assert warm_pids(pool, 0) == []
    pool.refill({0: (launch.argv, launch.env)})
    fresh = warm_pids(pool, 0)
    assert len(fresh) == 1 and fresh != warm
    wait_ready(pool, [0])
    assert harness.finish(group)[0].returncode == 0
    pool.refill({0: (launch.argv, {**launch.env, "OMP_NUM_THREADS": "4"})})  # does not fit
    replaced = warm_pids(pool, 0)
    assert len(replaced) == 1 and replaced != fresh
    assert wait_gone(fresh[0]), "the process that no longer fits was not reaped"


def test_close_reaps_every_idle_and_importing_process(harness: Harness, tmp_path: Path) -> None:
    ready_pool, launch, _ = _ready_pool(harness, tmp_path / "a")
    ready_pool.refill({1: (launch.argv, {**launch.env, "LOCAL_RANK": "1"})})
    wait_ready(ready_pool, [0, 1])
    importing_pool, _, release = pool_still_importing(harness, tmp_path / "b")
    pids = [*warm_pids(ready_pool, 0), *warm_pids(ready_pool, 1), *warm_pids(importing_pool, 0)]
    assert len(pids) == 3 and all(alive(p) for p in pids)
    ready_pool.close()
    importing_pool.close()
    for pid in pids:
        assert wait_gone(pid, timeout=0.5), f"warm pid {pid} left after close()"
    ready_pool.close()  # idempotent
    ready_pool.refill({0: (launch.argv, launch.env)})  # a closed pool starts nothing
    assert warm_pids(ready_pool, 0) == []
    assert not release.exists()

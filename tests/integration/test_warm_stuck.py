"""A warm interpreter whose import hangs is not waited for and is given up (issue 21,
item 7): before, one import at a time per local rank meant a hung one blocked every
refill, and every later worker start waited 30 s for it.

The import hangs for real: the first import of a module after the test arms it blocks on
a FIFO, using no CPU, as an import stuck on a lock or a network file system does. Worst
moments: it hangs while the pool holds nothing else for its local rank, and it is the
very first import of the pool.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import pytest

from agent.workers.group import build_argv
from agent.workers.launch import WorkerLaunch
from agent.workers.warm import ImportBounds, WarmPool
from tests.integration.warm_support import (
    READY_WITHIN,
    Harness,
    alive,
    base_env,
    forked_pids,
    make_launch,
    wait_gone,
    warm_pids,
    write_probe,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


# The first import after the test creates ARM takes the file and blocks on a FIFO until
# the test opens it for writing (a hung import: no CPU at all); any other returns at once.
STUCK_ONCE = """
import os
arm, fifo = os.environ["STUCK_ARM"], os.environ["STUCK_FIFO"]
try:
    os.rename(arm, arm + ".taken")
except FileNotFoundError:
    pass
else:
    os.close(os.open(fifo, os.O_RDONLY))
"""

# Even at a load of 40 on two cores a runnable process gets CPU every few 100 ms: only the
# hung import goes 3 s without a tick.
BOUNDS = ImportBounds(check_s=0.2, overdue_idle_s=3.0, kill_idle_s=6.0, kill_s=120.0)


def _release(fifo: Path) -> None:
    """Let a blocked import go on (nothing happens when none is blocked)."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def _stuck_pool(harness: Harness, tmp_path: Path) -> tuple[WarmPool, WorkerLaunch, Path, Path]:
    write_probe(tmp_path)
    (tmp_path / "preload").mkdir()
    (tmp_path / "preload" / "stuckonce.py").write_text(STUCK_ONCE)
    arm, release = tmp_path / "arm", tmp_path / "fifo"
    os.mkfifo(release)
    env = base_env(
        PYTHONPATH=str(tmp_path / "preload"), STUCK_ARM=str(arm), STUCK_FIFO=str(release)
    )
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]), env)
    pool = harness.pool(["stuckonce"], bounds=BOUNDS)
    return pool, launch, arm, release


def _until(what: str, done: object, timeout: float = READY_WITHIN) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_start_takes_the_interpreter_started_beside_a_stuck_one(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool, launch, arm, release = _stuck_pool(harness, tmp_path)
    try:
        # A first start from the pool, as in a running job.
        pool.refill({0: (launch.argv, launch.env)})
        _until("the first interpreter to be ready", lambda: pool.ready_count(0) == 1)
        group = harness.start([launch], pool=pool, cwd=tmp_path)
        assert harness.finish(group)[0].returncode == 0
        # The refill after that start hangs in its import: nothing else is left.
        arm.write_text("")
        with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
            pool.refill({0: (launch.argv, launch.env)})
            [stuck] = warm_pids(pool, 0)
            _until("an interpreter beside the stuck one", lambda: len(warm_pids(pool, 0)) >= 2)
            beside = [p for p in warm_pids(pool, 0) if p != stuck]
            group = harness.start([launch], pool=pool, cwd=tmp_path)
            assert group.pids[0] in beside, "the start did not take an interpreter beside"
            assert harness.finish(group)[0].returncode == 0
            # Given up at its kill bound: killed, reaped, and replaced.
            assert wait_gone(stuck, 60), "the stuck interpreter was never given up"
            # The pool's thread says so after the process is gone: wait for its line.
            killed = (
                "warm start: local rank 0: a warm interpreter was killed: its import used no "
                "CPU for 6 s; starting another"
            )
            _until(
                "the pool to say it killed the stuck interpreter",
                lambda: killed in [r.getMessage() for r in caplog.records],
            )
        messages = [r.getMessage() for r in caplog.records]
        overdue = (
            "warm start: local rank 0: a warm interpreter's import used no CPU for 3 s; "
            "starting another beside it, and no worker start waits for it"
        )
        assert overdue in messages, messages
        assert pool.enabled
    finally:
        _release(release)


def test_a_stuck_first_import_is_given_up_and_replaced(harness: Harness, tmp_path: Path) -> None:
    pool, launch, arm, release = _stuck_pool(harness, tmp_path)
    arm.write_text("")
    try:
        pool.refill({0: (launch.argv, launch.env)})
        [stuck] = warm_pids(pool, 0)
        assert wait_gone(stuck, 60), "the stuck interpreter was never given up"
        _until("a replacement to be ready", lambda: pool.ready_count(0) == 1)
        [replacement] = warm_pids(pool, 0)
        assert replacement != stuck and alive(replacement)
        group = harness.start([launch], pool=pool, cwd=tmp_path)
        assert group.pids[0] == replacement
        assert harness.finish(group)[0].returncode == 0
    finally:
        _release(release)


def test_before_the_first_round_the_pool_is_full_once_its_one_import_is_done(
    harness: Harness, tmp_path: Path
) -> None:
    # A crash in the first seconds of a run finds a spare ready, as a late crash does:
    # before the first round the pool imports one interpreter per local rank and forks
    # it for the rest (no second import on the cores the first one needs).
    write_probe(tmp_path)
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]),
                         base_env())  # fmt: skip
    pool = harness.pool([], depth=2)
    pool.refill({0: (launch.argv, launch.env)})
    assert len(warm_pids(pool, 0)) == 1
    assert pool.wait_ready(READY_WITHIN, every=2)
    assert pool.ready_count(0) == 2
    assert len(forked_pids(pool, 0)) == 1

"""The warm pool's forked copies (:meth:`agent.workers.warm_interpreter.WarmInterpreter.fork`):
a refill forks a ready interpreter instead of importing another, the copies are this
process's children and are reaped by ``close``, dead spares are dropped, and a pool that
cannot fork (no subreaper mark, a copy never adopted) imports instead, with one warning.
A copy is told from an import by a preload that marks every interpreter running it (a
copy never does), never by timing. That a worker started from a copy equals a cold one
is in ``test_warm_torch.py`` (``test_a_worker_from_a_forked_copy_is_the_same_as_a_cold_one``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import agent.workers.warm_interpreter
from agent.workers.group import WorkerGroup, build_argv
from agent.workers.launch import WorkerLaunch
from agent.workers.warm import WarmPool
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


# Imported ahead by the interpreters of the pools below: marks each interpreter that runs
# its preload. A copy forked from a ready interpreter never does.
MARK = """
import os
open(os.path.join(os.environ["MARKS"], str(os.getpid())), "w").close()
"""


def _marking_pool(harness: Harness, tmp_path: Path) -> tuple[WarmPool, WorkerLaunch, Path]:
    """A pool two deep for local rank 0 of the exit:0 probe, full, whose preload marks
    each interpreter that imports (in the returned folder)."""
    write_probe(tmp_path)
    (tmp_path / "preload").mkdir()
    (tmp_path / "preload" / "mark.py").write_text(MARK)
    marks = tmp_path / "marks"
    marks.mkdir()
    env = base_env(PYTHONPATH=str(tmp_path / "preload"), MARKS=str(marks))
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]), env)
    pool = harness.pool(["mark"], depth=2)
    pool.refill({0: (launch.argv, launch.env)})
    assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill"
    return pool, launch, marks


def _one_left(
    harness: Harness, pool: WarmPool, launch: WorkerLaunch, cwd: Path
) -> tuple[WorkerGroup, int]:
    """Start a group from a full pool two deep, once the thread that waited for the
    import has ended (it forks, then tops the rank up once more: nothing may fork beside
    the test's own refill); returns the group and the one ready interpreter left."""
    for thread in threading.enumerate():
        if thread.name == "warm start 0":
            thread.join(30)
    group = harness.start([launch], pool=pool, cwd=cwd)
    [left] = warm_pids(pool, 0)
    return group, left


def _imported(marks: Path) -> set[int]:
    return {int(p.name) for p in marks.iterdir()}


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_refill_forks_a_ready_interpreter_and_imports_only_when_none_is_left(
    harness: Harness, tmp_path: Path
) -> None:
    pool, launch, marks = _marking_pool(harness, tmp_path)
    full = warm_pids(pool, 0)
    assert len(full) == 2 and len(_imported(marks)) == 1, "filled by one import and one fork"
    assert forked_pids(pool, 0) == [p for p in full if p not in _imported(marks)]
    assert all(_parent(p) == os.getpid() for p in full), "a forked copy is this process's child"

    group = harness.start([launch], pool=pool, cwd=tmp_path)  # takes one: one is left
    pool.refill({0: (launch.argv, launch.env)})  # forks the one left: full on return
    assert pool.ready_count(0) == 2
    [copy] = [p for p in warm_pids(pool, 0) if p not in full]
    assert copy not in _imported(marks) and _parent(copy) == os.getpid()
    assert harness.finish(group)[0].returncode == 0

    # A rank left with no ready interpreter imports one at once, then forks it.
    first = harness.start([launch], pool=pool, cwd=tmp_path)
    second = harness.start([launch], pool=pool, cwd=tmp_path)
    assert pool.ready_count(0) == 0
    before = _imported(marks)
    pool.refill({0: (launch.argv, launch.env)})
    assert len(warm_pids(pool, 0)) == 1, "a rank with nothing ready imports one, at once"
    assert pool.wait_ready(READY_WITHIN, every=2), "the import was not forked for the rest"
    assert len(_imported(marks) - before) == 1
    assert harness.finish(first)[0].returncode == 0
    assert harness.finish(second)[0].returncode == 0


def test_close_right_after_a_fork_reaps_the_copies_and_the_rest(
    harness: Harness, tmp_path: Path
) -> None:
    # The copies are this process's children, adopted: close must reap them as it reaps
    # the interpreters it started (no zombie left here).
    pool, launch, _ = _marking_pool(harness, tmp_path)
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    pool.refill({0: (launch.argv, launch.env)})
    held = warm_pids(pool, 0)
    assert len(held) == 2 and forked_pids(pool, 0)
    pool.close()
    for pid in held:
        assert wait_gone(pid), f"warm pid {pid} left after close()"
    pool.refill({0: (launch.argv, launch.env)})  # a closed pool forks nothing
    assert warm_pids(pool, 0) == []
    assert harness.finish(group)[0].returncode == 0


def test_a_pool_that_cannot_fork_refills_by_importing_with_one_warning(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # A kernel or sandbox that refuses the subreaper mark (or the fork): the pool must
    # not throw its live interpreters away one after another; it imports, as before.
    def refused() -> contextlib.AbstractContextManager[None]:
        raise OSError(errno.EPERM, "prctl(36) failed")

    monkeypatch.setattr(agent.workers.warm_interpreter, "adopting", refused)
    write_probe(tmp_path)
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]),
                         base_env())  # fmt: skip
    pool = harness.pool([], depth=2)
    with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
        pool.refill({0: (launch.argv, launch.env)})
        assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill by imports"
    assert forked_pids(pool, 0) == [] and len(warm_pids(pool, 0)) == 2
    assert [r.getMessage() for r in caplog.records] == [
        "warm start: local rank 0: a warm interpreter could not be forked (PermissionError: "
        "[Errno 1] prctl(36) failed); refills import new interpreters from now on"
    ]
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    pool.refill({0: (launch.argv, launch.env)})
    assert forked_pids(pool, 0) == []
    assert harness.finish(group)[0].returncode == 0


def test_ready_interpreters_killed_while_idle_are_dropped_at_the_next_refill(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The OOM killer takes a rank's spares: the next refill must not count them (nor try
    # to fork them): it drops each with one warning and imports, then forks that one.
    pool, launch, marks = _marking_pool(harness, tmp_path)
    victims = warm_pids(pool, 0)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in victims):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    before = _imported(marks)
    with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
        pool.refill({0: (launch.argv, launch.env)})
        assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill again"
    dropped = (
        "warm start: local rank 0: a warm interpreter died while it waited (exit code -9); "
        "dropping it"
    )
    assert [r.getMessage() for r in caplog.records] == [dropped, dropped]
    assert not set(warm_pids(pool, 0)) & set(victims)
    assert len(_imported(marks) - before) == 1 and len(forked_pids(pool, 0)) == 1
    assert all(wait_gone(p) for p in victims), "a dropped interpreter was not reaped"


def _running_with(marker: str) -> list[int]:
    """Live processes whose start-time environment holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{entry}/environ").read_bytes():
                    found.append(int(entry))
    return [p for p in found if alive(p)]


def test_a_copy_nobody_adopts_exits_at_once_and_the_pool_imports_instead(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # The worst moment for a copy: its middle process exits while the agent is not (or no
    # longer) marked to adopt it, as when the agent dies mid-fork. The kernel hands the
    # copy to another ancestor; it must end at once (not wait out its 10 s, not live on
    # as a spare nobody owns), and the pool must import instead, with one warning.
    monkeypatch.setattr(agent.workers.warm_interpreter, "adopting", contextlib.nullcontext)
    marker = f"WARM_FORK_MARKER={os.getpid()}-{time.monotonic_ns()}"
    write_probe(tmp_path)
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]),
                         base_env(WARM_FORK_MARKER=marker.split("=", 1)[1]))  # fmt: skip
    pool = harness.pool([], depth=2)
    with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
        began = time.monotonic()
        pool.refill({0: (launch.argv, launch.env)})
        assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill by imports"
        took = time.monotonic() - began
    # Two imports of nothing and a refused fork: well under the 10 s a fork waits for its
    # copy, which is what a copy that did not notice it was given away would cost.
    assert took < 8.0, f"the pool took {took:.1f} s: the fork waited for its copy"
    assert [r.getMessage() for r in caplog.records] == [
        "warm start: local rank 0: a warm interpreter could not be forked (the copy "
        "exited); refills import new interpreters from now on"
    ]
    assert forked_pids(pool, 0) == []
    deadline = time.monotonic() + 5  # a copy left waiting would live 10 s
    while set(_running_with(marker)) - set(warm_pids(pool, 0)):
        assert time.monotonic() < deadline, "a copy nobody adopted lives on"
        time.sleep(0.05)


def test_a_stopped_spare_is_dropped_at_once_and_the_pool_keeps_forking(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A ready interpreter SIGSTOPped (by an operator, a debugger, a frozen cgroup) would
    # not answer a fork request: asked anyway, the refill waited 10 s, then turned forking
    # off for good. It is dropped without being asked, and the next source forks.
    pool, launch, marks = _marking_pool(harness, tmp_path)
    group, stopped = _one_left(harness, pool, launch, tmp_path)
    os.kill(stopped, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not agent.workers.warm_interpreter._stopped(stopped):
        assert time.monotonic() < deadline, "SIGSTOP did not stop the interpreter"
        time.sleep(0.01)
    before = _imported(marks)
    with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
        start = time.monotonic()
        pool.refill({0: (launch.argv, launch.env)})
        took = time.monotonic() - start
        assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill again"
    assert took < 5, f"the refill waited {took:.1f} s on the stopped interpreter"
    assert [r.getMessage() for r in caplog.records] == [
        "warm start: local rank 0: a warm interpreter did not fork (it is stopped (SIGSTOP?) "
        "and would not answer); dropping it"
    ]
    assert wait_gone(stopped), "the stopped interpreter was not killed and reaped"
    # The rank imported one, then forked it for the rest: forking is still on.
    assert len(_imported(marks) - before) == 1 and len(forked_pids(pool, 0)) == 1
    assert harness.finish(group)[0].returncode == 0


def test_a_spare_that_does_not_answer_a_fork_is_dropped_and_the_pool_keeps_forking(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Its worst moment: stopped (or hung) after the pool looked, while it is asked. The
    # request times out (10 s; not shortened: a healthy copy under load must not miss
    # it); the spare is dropped, and forking stays on for the rest.
    monkeypatch.setattr(agent.workers.warm_interpreter, "_stopped", lambda _pid: False)
    pool, launch, marks = _marking_pool(harness, tmp_path)
    group, hung = _one_left(harness, pool, launch, tmp_path)
    os.kill(hung, signal.SIGSTOP)
    before = _imported(marks)
    with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
        pool.refill({0: (launch.argv, launch.env)})
        assert pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill again"
    assert [r.getMessage() for r in caplog.records] == [
        "warm start: local rank 0: a warm interpreter did not fork (TimeoutError: timed "
        "out); dropping it"
    ]
    assert wait_gone(hung), "the interpreter that did not answer was not killed and reaped"
    assert len(_imported(marks) - before) == 1 and len(forked_pids(pool, 0)) == 1
    assert harness.finish(group)[0].returncode == 0

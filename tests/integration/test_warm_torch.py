"""Warm starts with torch preloaded, against cold ones: script mode with OMP_NUM_THREADS 1,
unset and 3, the error file of ``@record``, a worker from a forked copy, the preloaded
modules as the only import state that differs, and interpreters killed while importing.
One module-wide pool imports torch while the module's first tests run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.workers.errorfile import read_failure
from agent.workers.group import build_argv
from agent.workers.launch import WorkerLaunch
from tests.integration.warm_support import (
    MP_MAIN_BUG,
    PY,
    READY_WITHIN,
    Harness,
    Run,
    base_env,
    differences,
    forked_pids,
    make_launch,
    pool_still_importing,
    started_cold,
    wait_gone,
    wait_ready,
    warm_pids,
    write_probe,
)

# -- torch: one module-wide pool, started as the module starts ---------------------------

TORCH_CASES = {
    # local rank: (what the probe does, OMP_NUM_THREADS, extra environment)
    0: ("exit:0", "1", {"PYTHONHASHSEED": "123"}),
    1: ("record", None, {}),
    2: ("exit:0", "3", {}),
}


class TorchRuns:
    """The torch cases, cold, warm and forked: the pool and the cold workers start at
    once (importing torch in parallel); the warm workers start when asked, once ready,
    from the interpreters that imported torch; the forked ones after them, from the
    copies the pool forked from those (two per local rank)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.harness = Harness()
        write_probe(root)
        self.launches: dict[str, list[WorkerLaunch]] = {}
        for kind in ("cold", "warm", "forked"):
            self.launches[kind] = [
                make_launch(
                    root / kind, lr,
                    build_argv("src/probe.py", [action, "a b", "--x=${local_rank}"]),
                    base_env(PROBE_TORCH="1", **extra), omp=omp,
                )
                for lr, (action, omp, extra) in TORCH_CASES.items()
            ]  # fmt: skip
        self.pool = self.harness.pool(["torch"], depth=2)
        self.pool.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in self.launches["warm"]})
        self.cold_group = self.harness.start(self.launches["cold"], cwd=root)
        self._result: tuple[dict[int, Run], dict[int, Run]] | None = None
        self._forked: dict[int, Run] | None = None

    def result(self) -> tuple[dict[int, Run], dict[int, Run]]:
        if self._result is None:
            cold = self.harness.finish(self.cold_group)
            assert self.pool.wait_ready(READY_WITHIN, every=2), "the pool did not fill"
            ready = {
                lr: [p for p in warm_pids(self.pool, lr) if p not in forked_pids(self.pool, lr)]
                for lr in TORCH_CASES
            }
            group = self.harness.start(self.launches["warm"], pool=self.pool, cwd=self.root)
            for lr, pid in group.pids.items():
                assert [pid] == ready[lr], f"local rank {lr} did not start warm"
            self._result = cold, self.harness.finish(group)
        return self._result

    def forked(self) -> dict[int, Run]:
        """The same launches started from copies forked from a ready interpreter."""
        if self._forked is None:
            self.result()
            copies = {lr: forked_pids(self.pool, lr) for lr in TORCH_CASES}
            assert all(copies.values()), f"no forked copy ready: {copies}"
            group = self.harness.start(self.launches["forked"], pool=self.pool, cwd=self.root)
            self.pool.close()  # nothing more to start from it
            for lr, pid in group.pids.items():
                assert pid in copies[lr], f"local rank {lr} did not start from a forked copy"
            self._forked = self.harness.finish(group)
        return self._forked


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchRuns]:
    runs = TorchRuns(tmp_path_factory.mktemp("torch_runs"))
    try:
        yield runs
    finally:
        runs.harness.close()


@pytest.fixture(scope="module", autouse=True)
def _torch_runs_start_early(request: pytest.FixtureRequest) -> None:
    """Start the torch imports with the module's first test when any selected test
    needs them, so they overlap the cheaper tests instead of following them."""
    if any(
        "torch_runs" in getattr(item, "fixturenames", ())
        for item in request.session.items
        if item.module is request.module
    ):
        request.getfixturevalue("torch_runs")


# -- what is the same ---------------------------------------------------------------------


def test_script_mode_with_torch_and_omp_1_is_the_same(torch_runs: TorchRuns) -> None:
    cold, warm = torch_runs.result()
    assert differences(cold[0], warm[0], skip=MP_MAIN_BUG) == {}
    rec = warm[0].record
    root = str(torch_runs.root)
    assert rec["name"] == "__main__"
    assert rec["file"] == f"{root}/src/probe.py"  # absolute, as given (relative to the cwd)
    assert rec["argv"] == ["src/probe.py", "exit:0", "a b", "--x=0"]
    assert rec["orig_argv"] == [PY, "-u", "src/probe.py", "exit:0", "a b", "--x=0"]
    assert rec["path"][0] == f"{root}/src"
    assert rec["cwd"] == root
    assert (rec["loader"], rec["cached"], rec["spec"]) == ("SourceFileLoader", None, "None")
    assert rec["ours"] == [] and cold[0].record["ours_files"] == []
    assert rec["stdin"] == ""
    assert rec["cuda_initialized"] is False
    assert rec["torch_threads"] == 1
    assert rec["env"]["OMP_NUM_THREADS"] == "1"
    assert rec["env"]["PYTHONHASHSEED"] == "123" and rec["hash"] == cold[0].record["hash"]
    assert rec["env"] == rec["child_env"]  # the C environment was replaced too
    assert rec["pdeathsig"] == signal.SIGKILL and rec["session_leader"]
    assert rec["signals"]["SIGTERM"] == "<Handlers.SIG_DFL: 0>"
    assert rec["signals"]["SIGINT"] == "<built-in function default_int_handler>"
    assert rec["signals"]["SIGPIPE"] == "<Handlers.SIG_IGN: 1>"  # Python's own, both
    assert (cold[0].returncode, warm[0].returncode) == (0, 0)
    assert warm[0].stderr == cold[0].stderr == ""


def test_omp_num_threads_unset_gives_torchs_default_in_both(torch_runs: TorchRuns) -> None:
    cold, warm = torch_runs.result()
    assert differences(cold[1], warm[1], skip=MP_MAIN_BUG) == {}
    assert "OMP_NUM_THREADS" not in warm[1].record["env"]
    assert warm[1].record["torch_threads"] == cold[1].record["torch_threads"]


def test_omp_num_threads_3_is_the_same(torch_runs: TorchRuns) -> None:
    cold, warm = torch_runs.result()
    assert differences(cold[2], warm[2], skip=MP_MAIN_BUG) == {}
    assert warm[2].record["env"]["OMP_NUM_THREADS"] == "3"
    # torch caps the count at the machine's cores: 3 on 3 or more, 2 on 2 cores.
    assert warm[2].record["torch_threads"] == cold[2].record["torch_threads"]
    assert warm[2].record["torch_threads"] == min(3, len(os.sched_getaffinity(0)))


def test_torch_error_file_of_record_is_the_same(torch_runs: TorchRuns) -> None:
    cold, warm = torch_runs.result()
    assert (cold[1].returncode, warm[1].returncode) == (1, 1)
    files = []
    for run in (cold[1], warm[1]):
        content = json.loads(Path(run.error_file).read_text())
        assert set(content) == {"message"}
        timestamp = content["message"]["extraInfo"].pop("timestamp")
        assert abs(int(timestamp) - time.time()) < 600
        files.append(content)
        failure = read_failure(
            global_rank=1, local_rank=1, pid=run.pid, exitcode=run.returncode,
            error_file=run.error_file, observed_at=time.time(),
        )  # fmt: skip
        assert failure.message == "ValueError: probe failed on purpose"
        assert failure.exitcode == 1
        assert 'raise ValueError("probe failed on purpose")' in failure.traceback
        assert "warm_process" not in failure.traceback
    assert files[0] == files[1]


@pytest.mark.parametrize("local_rank", sorted(TORCH_CASES))
def test_a_worker_from_a_forked_copy_is_the_same_as_a_cold_one(
    torch_runs: TorchRuns, local_rank: int
) -> None:
    """A copy forked from a ready interpreter (how the pool refills) is, to the worker,
    the interpreter that imported torch: every generic field equal to a cold start's,
    the parent, the parent-death signal, the session, BLAS's threads and torch's
    included; its preloaded modules as the original's."""
    cold, warm = torch_runs.result()
    forked = torch_runs.forked()
    c, f = cold[local_rank].record, forked[local_rank].record
    assert differences(cold[local_rank], forked[local_rank], skip=MP_MAIN_BUG) == {}
    assert f["ppid"] == c["ppid"] == os.getpid()
    assert f["pdeathsig"] == signal.SIGKILL and f["session_leader"] and f["group_leader"]
    for key in ("os_threads", "threads", "torch_threads", "hash", "signals", "sigstatus"):
        assert f.get(key) == c.get(key), key
    assert f["modules"] == warm[local_rank].record["modules"]
    assert forked[local_rank].returncode == cold[local_rank].returncode
    assert forked[local_rank].stderr == cold[local_rank].stderr


def test_preloaded_modules_are_the_only_import_state_that_differs(torch_runs: TorchRuns) -> None:
    """A warm worker finds torch (and what it imports) already in sys.modules before its
    first line; once the worker imported torch itself, the state torch's import leaves
    (warnings filters, atexit callbacks, signal handlers, threads) is the same. Beyond
    torch's closure, the warm worker also holds the few standard modules the warm
    program itself imports; never one of ours."""
    cold, warm = torch_runs.result()
    c, w = cold[0].record, warm[0].record
    assert c["pre_imported"] == {"torch": False, "numpy": False}
    assert w["pre_imported"] == {"torch": True, "numpy": True}
    for key in ("warnings", "atexit", "signals", "sigstatus", "threads", "os_threads"):
        assert c[key] == w[key], key
    assert set(c["modules"]) - set(w["modules"]) == set()
    extra = set(w["modules"]) - set(c["modules"])
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in extra), sorted(extra)
    assert not any(m.split(".")[0] in ("agent", "coordinator", "warm_process") for m in extra)


def test_an_interpreter_killed_while_importing_is_replaced_and_warm_starts_stay_on(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The OOM killer, or an operator, kills an interpreter mid-import: not a reason to turn
    # warm starts off for the rest of the run (an import error is: the test above).
    pool, launch, release = pool_still_importing(harness, tmp_path)
    try:
        [victim] = warm_pids(pool, 0)
        with caplog.at_level(logging.WARNING, logger="agent.workers.warm"):
            os.kill(victim, signal.SIGKILL)
            assert wait_gone(victim), "the killed interpreter was not reaped"
            deadline = time.monotonic() + 30
            while warm_pids(pool, 0) in ([], [victim]):
                assert time.monotonic() < deadline, "no interpreter replaced the killed one"
                time.sleep(0.02)
        assert pool.enabled
        [replacement] = warm_pids(pool, 0)
        assert replacement != victim
        assert [r.getMessage() for r in caplog.records] == [
            "warm start: local rank 0: a warm interpreter died while importing (it exited "
            "while starting, exit code -9); starting another"
        ]
        release.write_text("")
        wait_ready(pool, [0])
        group = harness.start([launch], pool=pool, cwd=tmp_path)
        assert group.pids[0] == replacement
        assert harness.finish(group)[0].returncode == 0
    finally:
        release.write_text("")


def test_interpreters_that_keep_dying_while_importing_turn_warm_starts_off(
    harness: Harness, tmp_path: Path
) -> None:
    pool, launch, release = pool_still_importing(harness, tmp_path)
    try:
        killed: list[int] = []
        deadline = time.monotonic() + 60
        while pool.enabled:
            assert time.monotonic() < deadline, "warm starts stayed on"
            for pid in warm_pids(pool, 0):
                if pid not in killed:
                    killed.append(pid)
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        assert len(killed) == 3
        assert all(wait_gone(pid) for pid in killed)
        assert warm_pids(pool, 0) == []
        assert started_cold(harness, pool, launch, killed, tmp_path).returncode == 0
    finally:
        release.write_text("")

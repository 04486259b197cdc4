"""Real worker subprocesses: environment, stop/kill/reap, wake-up latency, logs, errors."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from agent.loop.ranks import Assignment
from agent.workers.errorfile import read_failure
from agent.workers.group import (
    GroupInfo,
    WorkerGroup,
    WorkerLaunch,
    WorkerStartError,
    build_argv,
    worker_env,
)
from agent.workers.logs import LogSpec, RunLogDir, console_prefix, plan_attempt
from agent.workers.state import WorkerState

TORCHRUN_VARS = (
    "LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip

GROUP = GroupInfo(
    role="trainer", group_rank=1, group_world_size=3, local_world_size=2,
    master_addr="10.0.0.7", master_port=29511, restart_count=2, max_restarts=5,
    run_id="job42", use_agent_store=False,
)  # fmt: skip
ASSIGNMENT = Assignment(base_global_rank=2, world_size=6, base_role_rank=2, role_world_size=6)


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


class Groups:
    """Starts worker groups for a test and always stops (reaps) them afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.groups: list[WorkerGroup] = []
        self.wake = threading.Event()
        self.wake_times: list[float] = []
        self.out = io.StringIO()
        self.err = io.StringIO()

    def _on_wake(self) -> None:
        self.wake_times.append(time.monotonic())
        self.wake.set()

    def start(
        self,
        argv: list[str],
        *,
        nproc: int = 2,
        spec: LogSpec | None = None,
        base_env: Mapping[str, str] | None = None,
        attempt: int = 0,
    ) -> tuple[WorkerGroup, Path]:
        spec = spec or LogSpec()
        attempt_dir = RunLogDir(str(self.tmp_path / "logs"), "job42").attempt(attempt, range(nproc))
        ranks = {lr: ASSIGNMENT.worker(lr) for lr in range(nproc)}
        prefixes = {
            lr: console_prefix(None, "trainer", r.global_rank, lr) for lr, r in ranks.items()
        }
        plans = plan_attempt(spec, attempt_dir, prefixes)
        env = dict(os.environ if base_env is None else base_env)
        group_info = GroupInfo(**{**GROUP.__dict__, "local_world_size": nproc})
        envs = {lr: worker_env(env, group_info, ranks[lr], plans[lr].error_file) for lr in ranks}
        launches = [WorkerLaunch(ranks[lr], argv, envs[lr], plans[lr]) for lr in range(nproc)]
        group = WorkerGroup(launches, self._on_wake, console_out=self.out, console_err=self.err)
        self.groups.append(group)
        group.start()
        return group, attempt_dir

    def wait_done(self, group: WorkerGroup, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while group.state() is WorkerState.HEALTHY:
            assert self.wake.wait(max(0.0, deadline - time.monotonic())), "workers hung"
            self.wake.clear()

    def close(self) -> None:
        for group in self.groups:
            group.stop(grace=1.0)


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[Groups]:
    g = Groups(tmp_path)
    try:
        yield g
    finally:
        g.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie re-parented to a non-reaping init is dead too


DUMP_ENV = """
    import json, os, sys
    names = sys.argv[1].split(",")
    out = os.path.join(sys.argv[2], os.environ["LOCAL_RANK"] + ".json")
    with open(out, "w") as f:
        json.dump({n: os.environ.get(n) for n in names}, f)
"""


def test_environment_is_torchruns(groups: Groups, tmp_path: Path) -> None:
    script = _script(tmp_path, "dump.py", DUMP_ENV)
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    }
    group, attempt_dir = groups.start(
        build_argv(script, [",".join(TORCHRUN_VARS), str(tmp_path)]), base_env=base
    )
    groups.wait_done(group)
    assert group.state() is WorkerState.SUCCEEDED
    for lr in (0, 1):
        env = json.loads((tmp_path / f"{lr}.json").read_text())
        assert env == {
            "LOCAL_RANK": str(lr), "RANK": str(2 + lr), "GROUP_RANK": "1",
            "ROLE_RANK": str(2 + lr), "ROLE_NAME": "trainer", "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "6", "GROUP_WORLD_SIZE": "3", "ROLE_WORLD_SIZE": "6",
            "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511",
            "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "5",
            "TORCHELASTIC_RUN_ID": "job42", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": str(attempt_dir / str(lr) / "error.json"),
            "OMP_NUM_THREADS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        }  # fmt: skip


def test_user_settings_win_and_single_worker_keeps_omp_unset(
    groups: Groups, tmp_path: Path
) -> None:
    script = _script(tmp_path, "dump.py", DUMP_ENV)
    names = "OMP_NUM_THREADS,TORCH_NCCL_ASYNC_ERROR_HANDLING,MY_VAR"
    base = {**os.environ, "OMP_NUM_THREADS": "7", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "MY_VAR": "x"}  # fmt: skip
    group, _ = groups.start(build_argv(script, [names, str(tmp_path)]), base_env=base)
    groups.wait_done(group)
    assert json.loads((tmp_path / "0.json").read_text()) == {
        "OMP_NUM_THREADS": "7", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "MY_VAR": "x",
    }  # fmt: skip
    bare = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    (tmp_path / "0.json").unlink()
    group, _ = groups.start(build_argv(script, [names, str(tmp_path)]), nproc=1, base_env=bare)
    groups.wait_done(group)
    assert json.loads((tmp_path / "0.json").read_text())["OMP_NUM_THREADS"] is None


STUBBORN = """
    import os, signal, subprocess, sys, time
    if os.environ["LOCAL_RANK"] == "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[1] + "." + os.environ["LOCAL_RANK"], "w") as f:
        f.write(str(child.pid))
    print("ready", flush=True)
    time.sleep(600)
"""


def test_stop_terminates_then_kills_and_reaps_everything(groups: Groups, tmp_path: Path) -> None:
    script = _script(tmp_path, "stubborn.py", STUBBORN)
    marker = tmp_path / "child"
    group, _ = groups.start(build_argv(script, [str(marker)]), spec=LogSpec(redirects={0: 1, 1: 1}))
    deadline = time.monotonic() + 60
    while not all(Path(f"{marker}.{lr}").exists() for lr in (0, 1)):
        assert time.monotonic() < deadline, "workers did not start"
        groups.wake.wait(0.05)  # no event exists for "a file appeared"; poll briefly
    children = [int(Path(f"{marker}.{lr}").read_text()) for lr in (0, 1)]
    pids = group.pids
    assert group.state() is WorkerState.HEALTHY

    start = time.monotonic()
    group.stop(grace=1.0)
    took = time.monotonic() - start

    exits = group.exits()
    assert exits[0].returncode == -signal.SIGKILL  # ignored SIGTERM
    assert exits[1].returncode == -signal.SIGTERM
    assert group.state() is WorkerState.STOPPED
    assert 1.0 <= took < 20.0
    for pid in pids.values():
        assert not _alive(pid), f"worker pid {pid} survived stop()"
    # The workers' own children got SIGKILL with the process group but are not ours to
    # reap: give the kernel a bounded moment to finish them.
    for pid in children:
        gone_by = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < gone_by:
            groups.wake.wait(0.02)
        assert not _alive(pid), f"child pid {pid} survived stop()"
    group.stop(grace=1.0)  # idempotent


def test_workers_outlive_the_thread_that_started_them(groups: Groups, tmp_path: Path) -> None:
    """Workers carry a parent-death signal, which the kernel ties to the thread that
    forked them: the agent (or a test running one in a thread) may start a group from a
    thread that then ends, and the workers must live on."""
    argv = build_argv(_script(tmp_path, "sleep.py", "import time; time.sleep(600)"), [])
    box: list[WorkerGroup] = []
    thread = threading.Thread(target=lambda: box.append(groups.start(argv)[0]))
    thread.start()
    thread.join()
    assert not groups.wake.wait(1.0), f"a worker exited: {box[0].exits()}"
    assert box[0].state() is WorkerState.HEALTHY


def test_exit_wakes_the_monitor_at_once(groups: Groups, tmp_path: Path) -> None:
    script = _script(tmp_path, "quick.py", """
        import os, sys, time
        time.sleep(0.3 + 0.3 * int(os.environ["LOCAL_RANK"]))
        with open(sys.argv[1] + os.environ["LOCAL_RANK"], "w") as f:
            f.write(repr(time.monotonic()))
        os._exit(3 if os.environ["LOCAL_RANK"] == "1" else 0)
    """)  # fmt: skip
    group, _ = groups.start(build_argv(script, [str(tmp_path / "t")]))
    groups.wait_done(group)
    assert group.state() is WorkerState.FAILED
    assert group.exits()[1].returncode == 3
    # CLOCK_MONOTONIC is shared by all processes, so the worker's last timestamp and the
    # wake-up are comparable; the bound is generous, the measured value is printed.
    latencies = []
    for lr, woke in zip((0, 1), sorted(groups.wake_times), strict=True):
        exited = float((tmp_path / f"t{lr}").read_text())
        latencies.append(woke - exited)
    print(f"exit-to-wake latency (s): {[round(x, 4) for x in latencies]}")
    assert all(0 <= x < 1.0 for x in latencies)


def test_redirects_tee_and_folders(
    groups: Groups, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "talk.py", """
        import os, sys
        r = os.environ["LOCAL_RANK"]
        print(f"out {r}")
        print(f"err {r}", file=sys.stderr)
    """)  # fmt: skip
    # rank 0: both streams to files only; rank 1: stdout tee'd, stderr left on the console.
    spec = LogSpec(redirects={0: 3}, tee={1: 1})
    group, attempt_dir = groups.start(build_argv(script, []), spec=spec, attempt=4)
    groups.wait_done(group)
    group.stop(grace=1.0)  # joins the pumps
    assert attempt_dir.name == "attempt_4"
    assert attempt_dir.parent.name.startswith("job42_")
    assert attempt_dir.parent.parent == tmp_path / "logs"
    assert (attempt_dir / "0" / "stdout.log").read_text() == "out 0\n"
    assert (attempt_dir / "0" / "stderr.log").read_text() == "err 0\n"
    assert (attempt_dir / "1" / "stdout.log").read_text() == "out 1\n"
    assert not (attempt_dir / "1" / "stderr.log").exists()
    assert groups.out.getvalue() == "[trainer1]:out 1\n"
    captured = capfd.readouterr()
    assert "err 1" in captured.err
    assert "out 0" not in captured.out + groups.out.getvalue()
    assert "err 0" not in captured.err


def test_local_ranks_filter(
    groups: Groups, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "talk.py", """
        import os, sys
        print("hello from " + os.environ["LOCAL_RANK"])
        print("plain err " + os.environ["LOCAL_RANK"], file=sys.stderr)
    """)  # fmt: skip
    spec = LogSpec(tee={0: 1, 1: 1}, local_ranks_filter=frozenset({1}))
    group, attempt_dir = groups.start(build_argv(script, []), spec=spec)
    groups.wait_done(group)
    group.stop(grace=1.0)
    assert groups.out.getvalue() == "[trainer1]:hello from 1\n"
    assert (attempt_dir / "0" / "stdout.log").read_text() == "hello from 0\n"
    err = capfd.readouterr().err
    assert "plain err 1" in err
    assert "plain err 0" not in err


def test_error_file_root_cause_from_record(groups: Groups, tmp_path: Path) -> None:
    script = _script(tmp_path, "boom.py", """
        import os
        from torch.distributed.elastic.multiprocessing.errors import record

        @record
        def main() -> None:
            raise RuntimeError("boom on rank " + os.environ["RANK"])

        main()
    """)  # fmt: skip
    group, attempt_dir = groups.start(
        build_argv(script, []), nproc=1, spec=LogSpec(redirects={0: 2})
    )
    groups.wait_done(group)
    exited = group.exits()[0]
    assert exited.returncode == 1
    failure = read_failure(
        global_rank=2, local_rank=0, pid=exited.pid, exitcode=exited.returncode,
        error_file=group.launches[0].logs.error_file, observed_at=exited.wall_time,
    )  # fmt: skip
    assert failure.message == "RuntimeError: boom on rank 2"
    assert 'raise RuntimeError("boom on rank " + os.environ["RANK"])' in failure.traceback
    assert failure.error_file == str(attempt_dir / "0" / "error.json")
    assert abs(failure.timestamp - exited.wall_time) < 60


def test_module_run_path_and_no_python(groups: Groups, tmp_path: Path) -> None:
    pkg = tmp_path / "mymod"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "import sys\nopen(sys.argv[-1], 'w').write(__name__ + ' ' + sys.argv[0])\n"
    (pkg / "__main__.py").write_text(body)
    script = _script(tmp_path, "rp.py", body)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for argv, out in (
        (build_argv("mymod", [str(tmp_path / "m")], module=True), "m"),
        (build_argv(script, [str(tmp_path / "r")], run_path=True), "r"),
        (build_argv(sys.executable, [script, str(tmp_path / "n")], no_python=True), "n"),
    ):
        group, _ = groups.start(argv, nproc=1, base_env=env)
        groups.wait_done(group)
        assert group.state() is WorkerState.SUCCEEDED, argv
        name, argv0 = (tmp_path / out).read_text().split(" ")
        assert name == "__main__"
        assert argv0.endswith(("__main__.py", "rp.py")), argv0


def test_missing_program_is_a_clear_error(groups: Groups, tmp_path: Path) -> None:
    with pytest.raises(WorkerStartError) as err:
        groups.start(build_argv("/nonexistent/prog", [], no_python=True), nproc=1)
    assert str(err.value) == (
        "cannot start local rank 0: '/nonexistent/prog': No such file or directory; "
        "check the program path (and --no-python)"
    )


def test_local_rank_macro() -> None:
    assert build_argv("t.py", ["--lr=${local_rank}", "x"], local_rank=3, python="py") == [
        "py", "-u", "t.py", "--lr=3", "x",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"^--no-python cannot be combined with --module"):
        build_argv("t", [], module=True, no_python=True)

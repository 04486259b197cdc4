"""What the warm-start tests share (:mod:`agent.workers.warm`): the probe a worker runs
to record everything it can observe about how it was started, the same launch run cold
and warm (:func:`cold_and_warm`), the record's comparison (:func:`differences`), and the
:class:`Harness` that stops, reaps and closes every group and pool a test started.

A warm start is proven by the started pid being the pid of the pool's ready process,
never by timing.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import agent.workers.warm
import agent.workers.warm_interpreter
from agent.workers.group import GroupInfo, WorkerGroup, build_argv, worker_env
from agent.workers.launch import WorkerLaunch, WorkerRanks
from agent.workers.logs import StreamPlan, WorkerLogs
from agent.workers.warm import WarmPool
from tests.integration.warm_probe import PROBE

REPO = Path(agent.workers.warm.__file__).resolve().parents[1]
WARM_PROGRAM = str(Path(agent.workers.warm.__file__).with_name("warm_process.py"))
PY = sys.executable
READY_WITHIN = 120.0  # seconds for a warm interpreter to import torch on a loaded machine

# -- running the same launch cold and warm ----------------------------------------------


@dataclass
class Run:
    """One worker's outcome."""

    returncode: int
    pid: int
    stdout: str
    stderr: str
    error_file: str
    root: Path  # this run's folder (normalized away when comparing)

    @property
    def record(self) -> dict[str, Any]:
        lines = [x for x in self.stdout.splitlines() if x.startswith("PROBE ")]
        assert len(lines) == 1, f"no probe record (exit {self.returncode}):\n{self.stderr}"
        text = lines[0][len("PROBE ") :].replace(str(self.root), "<RUN>")
        text = re.sub(r"(pipe|socket):\[\d+\]", r"\1:[]", text)  # inode numbers
        record: dict[str, Any] = json.loads(text)
        return record


def write_probe(where: Path) -> Path:
    """The probe at where/src/probe.py and as the module where/pkg/probe.py, and a
    symlink where/links/link.py to the first."""
    (where / "src").mkdir(parents=True, exist_ok=True)
    (where / "pkg").mkdir(exist_ok=True)
    (where / "links").mkdir(exist_ok=True)
    source = PROBE.replace("REPO", repr(str(REPO)))
    (where / "src" / "probe.py").write_text(source)
    (where / "pkg" / "__init__.py").write_text("")
    (where / "pkg" / "probe.py").write_text(source)
    link = where / "links" / "link.py"
    if not link.is_symlink():
        link.symlink_to(Path("..") / "src" / "probe.py")
    return where / "src" / "probe.py"


def base_env(**changes: str | None) -> dict[str, str]:
    """This process's environment without what would make the worker differ by accident,
    with ``changes`` applied (None removes)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "PYTHON_EXEC", "PYTHONHASHSEED")
        and not k.startswith(("PET_", "TORCHELASTIC_"))
    }
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def worker_env_of(base: Mapping[str, str], local_rank: int, error_file: str) -> dict[str, str]:
    group = GroupInfo(
        role="trainer", group_rank=0, group_world_size=1, local_world_size=4,
        master_addr="127.0.0.1", master_port=29599, restart_count=1, max_restarts=3,
        run_id="warmjob", use_agent_store=False,
    )  # fmt: skip
    ranks = WorkerRanks(local_rank, local_rank, local_rank, 4, 4)
    env = worker_env(base, group, ranks, error_file)
    if "OMP_NUM_THREADS" in base:
        env["OMP_NUM_THREADS"] = base["OMP_NUM_THREADS"]
    return env


def make_launch(
    root: Path,
    local_rank: int,
    argv: Sequence[str],
    base: Mapping[str, str],
    *,
    console: bool = False,
    omp: str | None = "1",
) -> WorkerLaunch:
    """A launch whose streams and error file are in root/<local_rank>/. ``omp``: the
    worker's OMP_NUM_THREADS (None: unset, as torchrun leaves it for one worker)."""
    folder = root / str(local_rank)
    folder.mkdir(parents=True, exist_ok=True)
    logs = WorkerLogs(
        StreamPlan(str(folder / "stdout.log"), console),
        StreamPlan(str(folder / "stderr.log"), console),
        str(folder / "error.json"),
        f"[w{local_rank}]:",
    )
    env = worker_env_of(base, local_rank, logs.error_file)
    if omp is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = omp
    return WorkerLaunch(WorkerRanks(local_rank, local_rank, local_rank, 4, 4), argv, env, logs)


def warm_pids(pool: WarmPool, local_rank: int) -> list[int]:
    # No public accessor tells which processes a pool holds (only ready_count); the
    # pids are read from the private slots, read-only, to prove which process a worker
    # was started from. A ``WarmPool.pids(local_rank)`` would replace this.
    slot = pool._slots.get(local_rank) or []
    warms = slot if isinstance(slot, list) else [slot]
    return [w.spawned.process.pid for w in warms]


def forked_pids(pool: WarmPool, local_rank: int) -> list[int]:
    """Which of ``warm_pids`` are copies forked from a ready interpreter (read as
    ``warm_pids`` reads them)."""
    return [w.spawned.process.pid for w in pool._slots.get(local_rank) or [] if w.forked]


def wait_ready(pool: WarmPool, local_ranks: Sequence[int], timeout: float = READY_WITHIN) -> None:
    """Until every local rank the pool was refilled for has a ready process."""
    assert pool.wait_ready(timeout), f"no warm process ready within {timeout:.0f} s"
    for lr in local_ranks:
        assert pool.ready_count(lr) >= 1, f"no warm process ready for local rank {lr}"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    """Until /proc has no entry for ``pid`` at all (reaped, not even a zombie)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class Harness:
    """Starts groups and pools for a test; stops, reaps and closes them all at the end."""

    def __init__(self) -> None:
        self.groups: list[WorkerGroup] = []
        self.pools: list[WarmPool] = []

    def pool(self, modules: Sequence[str] = (), **kw: Any) -> WarmPool:
        """One process per local rank, as a restart uses (the default depth of two
        doubles the imports for nothing here)."""
        kw.setdefault("depth", 1)
        pool = WarmPool(modules, **kw)
        self.pools.append(pool)
        return pool

    def start(
        self,
        launches: Sequence[WorkerLaunch],
        *,
        pool: WarmPool | None = None,
        cwd: Path | None = None,
        console: tuple[Any, Any] = (None, None),
        interrupted: threading.Event | None = None,
    ) -> WorkerGroup:
        group = WorkerGroup(
            launches, lambda: None, console_out=console[0], console_err=console[1], warm=pool,
            interrupted=interrupted,
        )  # fmt: skip
        self.groups.append(group)
        old = os.getcwd()
        if cwd is not None:
            os.chdir(cwd)  # a worker starts in the agent's directory, cold or warm
        try:
            group.start()
        finally:
            os.chdir(old)
        return group

    @staticmethod
    def finish(group: WorkerGroup, timeout: float = 120.0) -> dict[int, Run]:
        deadline = time.monotonic() + timeout
        while len(group.exits()) < len(group.launches):
            assert time.monotonic() < deadline, f"workers still run: {group.exits()}"
            time.sleep(0.02)
        group.stop(grace=1.0)  # joins the pumps
        runs = {}
        launches = {ln.ranks.local_rank: ln for ln in group.launches}
        for lr, exited in group.exits().items():
            logs = launches[lr].logs
            folder = Path(logs.error_file).parent
            read = {}
            for name in ("stdout", "stderr"):
                path = folder / f"{name}.log"
                read[name] = path.read_text() if path.exists() else ""
            runs[lr] = Run(
                exited.returncode, exited.pid, read["stdout"], read["stderr"], logs.error_file,
                folder.parent,
            )  # fmt: skip
        return runs

    def close(self) -> None:
        for group in self.groups:
            group.stop(grace=1.0)
        for pool in self.pools:
            pool.close()


def cold_and_warm(
    harness: Harness,
    root: Path,
    argvs: Mapping[int, Sequence[str]],
    base: Mapping[str, str],
    *,
    cwd: Path,
    modules: Sequence[str] = (),
    omp: str | None = "1",
    console: bool = False,
) -> tuple[dict[int, Run], dict[int, Run]]:
    """Run the launches cold, then warm from a pool refilled with the same launches;
    asserts each warm worker is the pool's process."""
    cold = [make_launch(root / "cold", lr, a, base, omp=omp) for lr, a in argvs.items()]
    warm = [make_launch(root / "warm", lr, a, base, omp=omp) for lr, a in argvs.items()]
    pool = harness.pool(modules)
    pool.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in warm})
    cold_runs = harness.finish(harness.start(cold, cwd=cwd))
    wait_ready(pool, list(argvs))
    ready = {lr: warm_pids(pool, lr) for lr in argvs}
    group = harness.start(warm, pool=pool, cwd=cwd)
    for lr, pid in group.pids.items():
        assert [pid] == ready[lr], f"local rank {lr} did not start from the warm process"
    return cold_runs, harness.finish(group)


# The fields compared by every case. Left out, each with its own test: "dunders"
# (a bug, below), "early_modules"/"modules"/"pre_imported" (what the warm interpreter
# imported before the worker's code, pinned below), "exec_env" (the exec-time
# environment block, pinned below).
NOT_GENERIC = ("dunders", "early_modules", "modules", "pre_imported", "exec_env")
# With torch preloaded, sys.modules["__mp_main__"] is the warm program (a bug with its
# own test below, test_multiprocessing_main_alias_is_the_workers_main).
MP_MAIN_BUG = ("ours_files",)


def differences(cold: Run, warm: Run, skip: Sequence[str] = ()) -> dict[str, Any]:
    a, b = cold.record, warm.record
    out: dict[str, Any] = {}
    for key in sorted(a.keys() | b.keys()):
        if key in NOT_GENERIC or key in skip or a.get(key) == b.get(key):
            continue
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out[key] = {
                k: (x.get(k), y.get(k)) for k in x.keys() | y.keys() if x.get(k) != y.get(k)
            }
        else:
            out[key] = (x, y)
    return out


SLOW_PRELOAD = """
import os, time
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["RELEASE_PRELOAD"]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def pool_still_importing(harness: Harness, tmp_path: Path) -> tuple[WarmPool, WorkerLaunch, Path]:
    """A pool whose process for local rank 0 is still importing until ``release`` exists."""
    write_probe(tmp_path)
    (tmp_path / "preload").mkdir()
    (tmp_path / "preload" / "slowpreload.py").write_text(SLOW_PRELOAD)
    release = tmp_path / "release"
    env = base_env(PYTHONPATH=str(tmp_path / "preload"), RELEASE_PRELOAD=str(release))
    launch = make_launch(tmp_path / "runs" / "w", 0, build_argv("src/probe.py", ["exit:0"]), env)
    pool = harness.pool(["slowpreload"])
    pool.refill({0: (launch.argv, launch.env)})
    return pool, launch, release


def started_cold(harness: Harness, pool: WarmPool, launch: WorkerLaunch, warm: list[int],
                  cwd: Path, **kw: Any) -> Run:  # fmt: skip
    group = harness.start([launch], pool=pool, cwd=cwd, **kw)
    pid = group.pids[launch.ranks.local_rank]
    assert pid not in warm
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if alive(pid) else b""
    assert WARM_PROGRAM.encode() not in cmdline
    return harness.finish(group)[launch.ranks.local_rank]

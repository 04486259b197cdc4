"""Warm starts against cold ones: a worker started from a warm interpreter
(:mod:`agent.workers.warm`) sees what the same worker started cold (``python -u``) sees.

A probe script records, as one JSON line on its stdout, everything a worker can observe
about how it was started (module globals, argv, sys.path, cwd, environment, signals,
flags, threads, torch's thread count, standard streams, descriptors, ...). Each case runs
the same launch cold (a ``WorkerGroup`` without a pool) and warm (a ``WarmPool`` refilled
with that launch, waited ready, then the same ``WorkerGroup`` start) and compares. A warm
start is proven by the started pid being the pid of the pool's ready process, never by
timing.

Differences found while writing these (tracebacks with the warm program's frames,
``__annotations__``, a normalised ``__file__``, the coerced ``LC_CTYPE``, the
``__mp_main__`` alias) are fixed and each pinned by its own test; the
differences a warm start cannot avoid (the preloaded modules, the process's own exec-time
command line and environment block) are pinned exactly by their own tests.

No etcd is needed, except by the one ``etcdrun --standalone`` test at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import agent.workers.warm
import agent.workers.warm_interpreter
from agent.workers.errorfile import read_failure
from agent.workers.group import GroupInfo, WorkerGroup, build_argv, worker_env
from agent.workers.launch import WorkerLaunch, WorkerRanks
from agent.workers.logs import StreamPlan, WorkerLogs
from agent.workers.warm import LATE_KEYS, WarmPool

REPO = Path(agent.workers.warm.__file__).resolve().parents[1]
WARM_PROGRAM = str(Path(agent.workers.warm.__file__).with_name("warm_process.py"))
PY = sys.executable
READY_WITHIN = 120.0  # seconds for a warm interpreter to import torch on a loaded machine

PROBE = r"""
import sys
_EARLY = sorted(sys.modules)
import json, os, signal, threading, time

_PRE = {m: m in sys.modules for m in ("torch", "numpy")}
if os.environ.get("PROBE_TORCH") == "1":
    import torch


def _status(*names):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in names:
                out[key] = value.strip()
    return out


def _record():
    import atexit, ctypes, faulthandler, gc, locale, re, resource, subprocess, warnings

    g = globals()
    pdeath = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeath), 0, 0, 0)  # PR_GET_PDEATHSIG
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    fds = {}
    for name in os.listdir(listing):
        if int(name) != listing:
            with __import__("contextlib").suppress(OSError):
                fds[name] = os.readlink(f"/proc/self/fd/{name}")
    os.close(listing)
    child = subprocess.run(["/usr/bin/env", "-0"], stdout=subprocess.PIPE, check=True).stdout
    with open("/proc/self/environ", "rb") as f:
        exec_env = f.read()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    umask = os.umask(0o22)
    os.umask(umask)
    ours = (os.path.join(REPO, "agent"), os.path.join(REPO, "coordinator"))
    rec = {
        "name": __name__,
        "file": g.get("__file__", "<absent>"),
        "spec": re.sub(r" at 0x[0-9a-f]+", "", repr(g.get("__spec__", "<absent>"))),
        "loader": type(g.get("__loader__")).__name__,
        "cached": g.get("__cached__", "<absent>"),
        "package": g.get("__package__", "<absent>"),
        "doc": g.get("__doc__", "<absent>"),
        "builtins": type(g.get("__builtins__")).__name__,
        "dunders": sorted(k for k in g if k.startswith("__") and k.endswith("__")),
        "main_is_this": sys.modules["__main__"].__dict__ is g,
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "child_env": dict(kv.split("=", 1) for kv in child.decode().split("\0") if kv),
        "exec_env": dict(kv.split("=", 1) for kv in exec_env.decode().split("\0") if kv),
        "signals": {
            s.name: repr(signal.getsignal(s))
            for s in signal.valid_signals()
            if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "sigmask": sorted(int(s) for s in mask),
        "sigstatus": _status("SigBlk", "SigIgn", "SigCgt"),
        "pdeathsig": pdeath.value,
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgrp() == os.getpid(),
        "ppid": os.getppid(),
        "flags": repr(sys.flags),
        "executable": sys.executable,
        "prefix": [sys.prefix, sys.base_prefix, sys.exec_prefix],
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "ours": sorted(m for m in sys.modules
                       if m.split(".")[0] in ("agent", "coordinator", "warm_process")),
        "ours_files": sorted(
            m for m, mod in list(sys.modules.items())
            if str(getattr(mod, "__file__", None) or "").startswith(ours)
        ),
        "stdin": sys.stdin.read(),
        "stdio": [[s.encoding, s.errors, s.line_buffering, s.write_through, s.isatty()]
                  for s in (sys.stdout, sys.stderr)] + [[sys.stdin.encoding, sys.stdin.errors]],
        "fds": fds,
        "umask": umask,
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "rlimits": {n: resource.getrlimit(getattr(resource, n))
                    for n in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS")},
        "recursion": sys.getrecursionlimit(),
        "switch": sys.getswitchinterval(),
        "gc": [gc.isenabled(), list(gc.get_threshold())],
        "faulthandler": faulthandler.is_enabled(),
        "hooks": [repr(sys.excepthook), repr(sys.displayhook), repr(threading.excepthook)],
        "meta_path": [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path],
        "path_hooks": len(sys.path_hooks),
        "warnings": [repr(f) for f in warnings.filters],
        "atexit": atexit._ncallbacks(),
        "locale": locale.setlocale(locale.LC_ALL, None),
        "hash": hash("probe") if os.environ.get("PYTHONHASHSEED") else None,
        "pre_imported": _PRE,
        "early_modules": _EARLY,
        "modules": sorted(sys.modules),
    }
    if "torch" in g:
        rec["torch_threads"] = torch.get_num_threads()
        rec["torch_interop_threads"] = torch.get_num_interop_threads()
        rec["cuda_initialized"] = torch.cuda.is_initialized()
    print("PROBE " + json.dumps(rec), flush=True)


_record()
_action = sys.argv[1]
if _action.startswith("exit:"):
    sys.exit(int(_action[5:]))
elif _action.startswith("sysexit:"):
    sys.exit(_action[8:])
elif _action == "raise":
    def failing():
        raise RuntimeError("uncaught on purpose")
    failing()
elif _action == "record":
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise ValueError("probe failed on purpose")

    main()
elif _action in ("wait", "wait-handle"):
    if _action == "wait-handle":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print("started", flush=True)
    time.sleep(600)
elif _action == "talk":
    print("out one", flush=True)
    print("err one", file=sys.stderr, flush=True)
    print("out two", flush=True)
"""


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


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    try:
        yield h
    finally:
        h.close()


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


# -- the light cases: a pool that preloads nothing (the mechanics do not depend on it) ----


def test_symlinked_script_is_the_same(harness: Harness, tmp_path: Path) -> None:
    write_probe(tmp_path)
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv("links/link.py", ["exit:0", "é", ""])},
        base_env(), cwd=tmp_path,
    )  # fmt: skip
    assert differences(cold[0], warm[0]) == {}
    rec = warm[0].record
    assert rec["file"] == f"{tmp_path}/links/link.py"  # the path as given, made absolute
    assert rec["path"][0] == f"{tmp_path}/src"  # the resolved folder
    assert rec["argv"] == ["links/link.py", "exit:0", "é", ""]


def test_module_mode_is_the_same(harness: Harness, tmp_path: Path) -> None:
    write_probe(tmp_path)
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv("pkg.probe", ["exit:0", "x"], module=True)},
        base_env(), cwd=tmp_path,
    )  # fmt: skip
    assert differences(cold[0], warm[0]) == {}
    rec = warm[0].record
    assert rec["name"] == "__main__"
    assert rec["argv"] == [f"{tmp_path}/pkg/probe.py", "exit:0", "x"]
    assert rec["path"][0] == str(tmp_path)
    assert rec["package"] == "pkg"
    assert rec["spec"].startswith("ModuleSpec(name='pkg.probe', loader=<")
    assert rec["orig_argv"] == [PY, "-u", "-m", "pkg.probe", "exit:0", "x"]


def test_run_path_mode_is_the_same(harness: Harness, tmp_path: Path) -> None:
    script = write_probe(tmp_path)
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv(str(script), ["exit:0"], run_path=True)},
        base_env(), cwd=tmp_path / "pkg",
    )  # fmt: skip
    assert differences(cold[0], warm[0]) == {}
    assert warm[0].record["dunders"] == cold[0].record["dunders"]
    assert warm[0].record["argv"] == [str(script), "exit:0"]
    assert warm[0].record["path"][0] == ""


def test_exit_codes_and_messages_are_the_same(harness: Harness, tmp_path: Path) -> None:
    write_probe(tmp_path)
    actions = ["exit:0", "exit:3", "sysexit:probe says goodbye", "raise"]
    argvs = {lr: build_argv("src/probe.py", [a]) for lr, a in enumerate(actions)}
    cold, warm = cold_and_warm(harness, tmp_path / "runs", argvs, base_env(), cwd=tmp_path)
    assert [cold[lr].returncode for lr in argvs] == [0, 3, 1, 1]
    assert [warm[lr].returncode for lr in argvs] == [0, 3, 1, 1]
    for lr in (0, 1, 2):
        assert warm[lr].stderr == cold[lr].stderr, lr
    assert warm[2].stderr == "probe says goodbye\n"
    for runs in (cold, warm):
        assert runs[3].stderr.startswith("Traceback (most recent call last):\n")
        assert runs[3].stderr.endswith("\nRuntimeError: uncaught on purpose\n")


def test_missing_script_is_the_same(harness: Harness, tmp_path: Path) -> None:
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv("nothere.py", ["x"])}, base_env(),
        cwd=tmp_path,
    )  # fmt: skip
    assert (cold[0].returncode, warm[0].returncode) == (2, 2)
    assert cold[0].stderr == (
        f"{PY}: can't open file '{tmp_path}/nothere.py': [Errno 2] No such file or directory\n"
    )
    assert warm[0].stderr == cold[0].stderr
    assert warm[0].stdout == cold[0].stdout == ""


def test_tee_reaches_the_file_and_the_console_with_the_prefix(
    harness: Harness, tmp_path: Path
) -> None:
    write_probe(tmp_path)
    argv = build_argv("src/probe.py", ["talk"])
    consoles = {}
    results = {}
    cold = make_launch(tmp_path / "runs" / "cold", 0, argv, base_env(), console=True)
    warm = make_launch(tmp_path / "runs" / "warm", 0, argv, base_env(), console=True)
    pool = harness.pool()
    pool.refill({0: (warm.argv, warm.env)})
    for kind, launch, with_pool in (("cold", cold, None), ("warm", warm, pool)):
        if with_pool is not None:
            wait_ready(pool, [0])
            ready = warm_pids(pool, 0)
        consoles[kind] = (_Console(), _Console())
        group = harness.start([launch], pool=with_pool, cwd=tmp_path, console=consoles[kind])
        if with_pool is not None:
            assert [group.pids[0]] == ready
        results[kind] = harness.finish(group)[0]
    c, w = results["cold"], results["warm"]
    assert (c.returncode, w.returncode) == (0, 0)
    assert differences(c, w) == {}
    assert w.stdout.startswith("PROBE {") and c.stdout.startswith("PROBE {")
    assert w.stdout.split("\n", 1)[1] == c.stdout.split("\n", 1)[1] == "out one\nout two\n"
    assert w.stderr == c.stderr == "err one\n"
    for kind in ("cold", "warm"):
        out, err = consoles[kind]
        assert out.lines[1:] == ["[w0]:out one\n", "[w0]:out two\n"], kind
        assert out.lines[0].startswith("[w0]:PROBE {"), kind
        assert err.lines == ["[w0]:err one\n"], kind
    assert c.record["stdio"] == w.record["stdio"]


class _Console:
    """A console stream that keeps what the pumps write (thread-safe enough: one pump)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def stopped_cold_and_warm(
    harness: Harness, tmp_path: Path, actions: Sequence[str], sig: signal.Signals
) -> tuple[dict[int, Run], dict[int, Run]]:
    """Probes that wait, started cold then warm, each group stopped with ``sig`` once
    every probe runs its own code."""
    write_probe(tmp_path)
    argvs = {lr: build_argv("src/probe.py", [a]) for lr, a in enumerate(actions)}
    results = {}
    pool = harness.pool()
    warm = [make_launch(tmp_path / "runs" / "warm", lr, a, base_env()) for lr, a in argvs.items()]
    cold = [make_launch(tmp_path / "runs" / "cold", lr, a, base_env()) for lr, a in argvs.items()]
    pool.refill({ln.ranks.local_rank: (ln.argv, ln.env) for ln in warm})
    for kind, launches in (("cold", cold), ("warm", warm)):
        with_pool = pool if kind == "warm" else None
        if with_pool is not None:
            wait_ready(pool, list(argvs))
            ready = {lr: warm_pids(pool, lr) for lr in argvs}
        group = harness.start(launches, pool=with_pool, cwd=tmp_path)
        if with_pool is not None:
            assert {lr: [pid] for lr, pid in group.pids.items()} == ready
        deadline = time.monotonic() + 60
        for ln in launches:
            out = Path(ln.logs.stdout.file or "")
            while "started\n" not in (out.read_text() if out.exists() else ""):
                assert time.monotonic() < deadline, f"{kind} worker did not start"
                assert not group.exits(), f"{kind} worker exited: {group.exits()}"
                time.sleep(0.02)
        group.stop(grace=10.0, sig=sig)
        results[kind] = harness.finish(group)
    return results["cold"], results["warm"]


def test_sigterm_from_stop_gives_the_same_returncode(harness: Harness, tmp_path: Path) -> None:
    cold, warm = stopped_cold_and_warm(harness, tmp_path, ["wait", "wait-handle"], signal.SIGTERM)
    assert {lr: r.returncode for lr, r in cold.items()} == {0: -signal.SIGTERM, 1: 7}
    assert {lr: r.returncode for lr, r in warm.items()} == {0: -signal.SIGTERM, 1: 7}
    assert warm[0].stderr == cold[0].stderr == warm[1].stderr == cold[1].stderr == ""


def test_sigint_from_stop_gives_the_same_returncode(harness: Harness, tmp_path: Path) -> None:
    """The agent passes Ctrl-C on as SIGINT: KeyboardInterrupt, then death by SIGINT."""
    cold, warm = stopped_cold_and_warm(harness, tmp_path, ["wait"], signal.SIGINT)
    assert (cold[0].returncode, warm[0].returncode) == (-signal.SIGINT, -signal.SIGINT)
    for run in (cold[0], warm[0]):
        assert run.stderr.startswith("Traceback (most recent call last):\n")
        assert run.stderr.endswith("\nKeyboardInterrupt\n")


# -- what a warm start cannot avoid: pinned exactly ---------------------------------------


def test_per_attempt_variables_come_from_the_worker_and_proc_environ_keeps_the_templates(
    harness: Harness, tmp_path: Path
) -> None:
    """The pool's process was started for an earlier attempt: torchrun's per-attempt
    variables differed. ``os.environ`` (and the C environment a child inherits) are the
    worker's; only the exec-time block that ``/proc/<pid>/environ`` shows (ps e, a
    monitoring agent) still holds the template's values, and ``/proc/<pid>/cmdline``
    shows the warm program."""
    write_probe(tmp_path)
    argv = build_argv("src/probe.py", ["exit:0"])
    launch = make_launch(tmp_path / "runs" / "warm", 0, argv, base_env())
    template = {**launch.env, "RANK": "99", "TORCHELASTIC_RESTART_COUNT": "0",
                "MASTER_PORT": "1", "ETCD_ELASTIC_ROUND": "4"}  # fmt: skip
    template.pop("TORCHELASTIC_ERROR_FILE")
    pool = harness.pool()
    pool.refill({0: (argv, template)})
    wait_ready(pool, [0])
    ready = warm_pids(pool, 0)
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    assert [group.pids[0]] == ready
    run = harness.finish(group)[0]
    rec = run.record
    assert (
        rec["env"]
        == rec["child_env"]
        == {k: v.replace(str(run.root), "<RUN>") for k, v in launch.env.items()}
    )
    assert rec["exec_env"] == template
    assert {k for k in rec["exec_env"].keys() | rec["env"].keys()
            if rec["exec_env"].get(k) != rec["env"].get(k)} <= LATE_KEYS  # fmt: skip


def test_warm_program_adds_only_standard_modules(harness: Harness, tmp_path: Path) -> None:
    """Even with nothing preloaded, a warm worker finds in sys.modules what the warm program
    imported for itself (json, socket, tempfile and what they import): standard modules
    only, never one of ours; nothing a cold worker has is missing."""
    write_probe(tmp_path)
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv("src/probe.py", ["exit:0"])}, base_env(),
        cwd=tmp_path,
    )  # fmt: skip
    c, w = cold[0].record, warm[0].record
    assert set(c["modules"]) - set(w["modules"]) == set()
    extra = set(w["modules"]) - set(c["modules"])
    assert {"socket", "tempfile"} <= extra
    assert all(m.split(".")[0] in sys.stdlib_module_names for m in extra), sorted(extra)
    assert w["ours"] == w["ours_files"] == []
    assert w["exec_env"] == c["exec_env"]  # the template was this very launch


def test_cmdline_of_a_warm_worker_is_the_warm_program(harness: Harness, tmp_path: Path) -> None:
    write_probe(tmp_path)
    argv = build_argv("src/probe.py", ["wait"])
    launch = make_launch(tmp_path / "runs" / "warm", 0, argv, base_env())
    pool = harness.pool(["json"])
    pool.refill({0: (argv, launch.env)})
    wait_ready(pool, [0])
    group = harness.start([launch], pool=pool, cwd=tmp_path)
    cmdline = Path(f"/proc/{group.pids[0]}/cmdline").read_bytes().split(b"\0")[:-1]
    assert [c.decode() for c in cmdline][:3] == [PY, "-u", WARM_PROGRAM]
    assert cmdline[-1] == b"json"


# -- differences found and fixed: each pinned so it cannot come back ----------------------


@pytest.mark.parametrize("how", ["exception", "SIGINT"])
def test_uncaught_exception_traceback_is_the_same(
    harness: Harness, tmp_path: Path, how: str
) -> None:
    if how == "SIGINT":  # KeyboardInterrupt is re-raised through the warm program's frames
        cold, warm = stopped_cold_and_warm(harness, tmp_path, ["wait"], signal.SIGINT)
    else:
        write_probe(tmp_path)
        cold, warm = cold_and_warm(
            harness, tmp_path / "runs", {0: build_argv("src/probe.py", ["raise"])}, base_env(),
            cwd=tmp_path,
        )  # fmt: skip
    assert cold[0].returncode == warm[0].returncode
    assert "warm_process.py" not in warm[0].stderr
    assert warm[0].stderr == cold[0].stderr


@pytest.mark.parametrize("mode", ["script", "module"])
def test_main_module_globals_are_the_same(harness: Harness, tmp_path: Path, mode: str) -> None:
    write_probe(tmp_path)
    argv = (
        build_argv("src/probe.py", ["exit:0"])
        if mode == "script"
        else build_argv("pkg.probe", ["exit:0"], module=True)
    )
    cold, warm = cold_and_warm(harness, tmp_path / "runs", {0: argv}, base_env(), cwd=tmp_path)
    assert warm[0].record["dunders"] == cold[0].record["dunders"]


def test_script_path_with_dot_dot_is_the_same(harness: Harness, tmp_path: Path) -> None:
    write_probe(tmp_path)
    (tmp_path / "run").mkdir()
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv("../src/./probe.py", ["exit:0"])},
        base_env(), cwd=tmp_path / "run",
    )  # fmt: skip
    assert cold[0].record["file"] == f"{tmp_path}/run/../src/./probe.py"
    assert differences(cold[0], warm[0]) == {}


def test_environment_without_a_locale_is_the_same(harness: Harness, tmp_path: Path) -> None:
    write_probe(tmp_path)
    base = {k: v for k, v in base_env().items() if not k.startswith(("LC_", "LANG"))}
    cold, warm = cold_and_warm(
        harness, tmp_path / "runs", {0: build_argv("src/probe.py", ["exit:0"])}, base,
        cwd=tmp_path,
    )  # fmt: skip
    assert cold[0].record["env"].get("LC_CTYPE") == "C.UTF-8"  # coerced, cold
    assert differences(cold[0], warm[0]) == {}


MP_MAIN = r"""
import json, multiprocessing, pickle, sys
from dataclasses import dataclass


@dataclass
class Point:
    x: int


# What a spawn child sends back for a class of the main script: the child runs the
# script as __mp_main__, so the pickle names __mp_main__.Point.
data = pickle.dumps(Point(1), protocol=0).replace(b"c__main__\n", b"c__mp_main__\n")
try:
    loaded = repr(pickle.loads(data))
except Exception as exc:
    loaded = f"{type(exc).__name__}: {exc}"
alias = sys.modules["__mp_main__"]
print(json.dumps({"same": alias is sys.modules["__main__"],
                  "alias": getattr(alias, "__file__", None), "loaded": loaded}))
"""


def test_multiprocessing_main_alias_is_the_workers_main(harness: Harness, tmp_path: Path) -> None:
    script = tmp_path / "mpmain.py"
    script.write_text(MP_MAIN)
    argv = build_argv(str(script), [])
    cold = make_launch(tmp_path / "runs" / "cold", 0, argv, base_env())
    warm = make_launch(tmp_path / "runs" / "warm", 0, argv, base_env())
    pool = harness.pool(["multiprocessing"])
    pool.refill({0: (warm.argv, warm.env)})
    c = harness.finish(harness.start([cold], cwd=tmp_path))[0]
    wait_ready(pool, [0])
    ready = warm_pids(pool, 0)
    group = harness.start([warm], pool=pool, cwd=tmp_path)
    assert [group.pids[0]] == ready
    w = harness.finish(group)[0]
    expected = {"same": True, "alias": str(script), "loaded": "Point(x=1)"}
    assert json.loads(c.stdout) == expected
    assert json.loads(w.stdout) == expected


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


def _started_cold(harness: Harness, pool: WarmPool, launch: WorkerLaunch, warm: list[int],
                  cwd: Path, **kw: Any) -> Run:  # fmt: skip
    group = harness.start([launch], pool=pool, cwd=cwd, **kw)
    pid = group.pids[launch.ranks.local_rank]
    assert pid not in warm
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes() if alive(pid) else b""
    assert WARM_PROGRAM.encode() not in cmdline
    return harness.finish(group)[launch.ranks.local_rank]


def test_no_python_starts_cold_and_leaves_the_warm_process_ready(
    harness: Harness, tmp_path: Path
) -> None:
    pool, _, warm = _ready_pool(harness, tmp_path)
    script = str(tmp_path / "src" / "probe.py")
    other = make_launch(tmp_path / "runs" / "np", 0, build_argv(PY, [script, "exit:0"],
                        no_python=True), base_env())  # fmt: skip
    run = _started_cold(harness, pool, other, warm, tmp_path)
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
    run = _started_cold(harness, pool, other, warm, tmp_path)
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
    run = _started_cold(harness, pool, WorkerLaunch(launch.ranks, argv, launch.env, launch.logs),
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
    run = _started_cold(harness, pool, other_rank, warm, tmp_path)
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
    assert _started_cold(harness, pool, launch, [], tmp_path).returncode == 0


SLOW_PRELOAD = """
import os, time
deadline = time.monotonic() + 60
while not os.path.exists(os.environ["RELEASE_PRELOAD"]) and time.monotonic() < deadline:
    time.sleep(0.02)
"""


def _importing_pool(harness: Harness, tmp_path: Path) -> tuple[WarmPool, WorkerLaunch, Path]:
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
    pool, launch, release = _importing_pool(harness, tmp_path)
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
    pool, launch, release = _importing_pool(harness, tmp_path)
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
        run = _started_cold(harness, pool, launch, warm, tmp_path)
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
    assert _started_cold(harness, pool, launch, [pid], tmp_path).returncode == 0
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
    importing_pool, _, release = _importing_pool(harness, tmp_path / "b")
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


# -- end to end: etcdrun restarts a failed worker from a warm interpreter -----------------

E2E_WORKER = r"""
import json, os, sys, time

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = int(os.environ["RANK"])
agent = os.getppid()


def warm_children():
    # local rank -> [(pid, ready)] of the agent's warm interpreters
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            if ppid != agent or b"warm_process.py" not in cmdline:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError):
            continue
        wchan = syscall = ""
        try:
            with open(f"/proc/{entry}/wchan") as f:
                wchan = f.read()
            with open(f"/proc/{entry}/syscall") as f:
                syscall = f.read().split()[0]
        except (OSError, IndexError):
            pass
        # A ready warm interpreter is blocked receiving its request (recvmsg).
        ready = "skb_wait" in wchan or syscall == "47"
        found.setdefault(int(env[b"LOCAL_RANK"]), []).append((int(entry), ready))
    return found


seen = warm_children()
if os.environ.get("WAIT_FOR_WARM") == "1" and attempt == 0 and rank == 1:
    deadline = time.monotonic() + 60
    while not all(any(r for _, r in seen.get(lr, [])) for lr in (0, 1)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
        seen = warm_children()
with open("/proc/self/cmdline", "rb") as f:
    cmdline = [c.decode() for c in f.read().split(b"\0")[:-1]]
record = {
    "attempt": attempt, "rank": rank, "pid": os.getpid(), "cmdline": cmdline,
    "orig_argv": sys.orig_argv, "argv": sys.argv,
    "warm": {str(lr): [p for p, r in v if r] for lr, v in seen.items()},
}
with open(os.environ["E2E_OUT"], "a") as f:
    f.write(json.dumps(record) + "\n")
if attempt == 0 and rank == 1:
    # Fail only once rank 0 has written its record: the agent stops rank 0 as soon as
    # rank 1 fails, and a cold rank 0 still scanning /proc would never write it.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(os.environ["E2E_OUT"]) as f:
            if '"rank": 0,' in f.read():  # a substring: a line being written may be cut
                break
        time.sleep(0.02)
    sys.exit(1)
"""


def _marked(marker: str) -> list[int]:
    needle = f"WARM_E2E_MARKER={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/environ").read_bytes() and alive(int(entry)):
                    found.append(int(entry))
    return found


def _etcdrun(tmp_path: Path, flags: Sequence[str], env: Mapping[str, str]) -> tuple[int, str]:
    """Run etcdrun in its own session; reap it and everything it left, whatever happens."""
    etcdrun = str(Path(PY).with_name("etcdrun"))
    marker = env["WARM_E2E_MARKER"]
    proc = subprocess.Popen(
        [etcdrun, "--standalone", "--nproc-per-node=2", "--max-restarts=1", *flags,
         str(tmp_path / "worker.py")],
        cwd=tmp_path, env={**env, "TMPDIR": str(tmp_path)}, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        deadline = time.monotonic() + 10
        while _marked(marker) and time.monotonic() < deadline:
            time.sleep(0.05)  # workers and warm interpreters die with the agent
        left = _marked(marker)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived etcdrun: {left}\n{out[-3000:]}"
    return proc.returncode, out


@pytest.mark.e2e
@pytest.mark.parametrize("warm_start", [True, False], ids=["warm", "no-warm-start"])
def test_etcdrun_restarts_a_failed_worker_from_a_warm_interpreter(
    tmp_path: Path, warm_start: bool
) -> None:
    (tmp_path / "worker.py").write_text(textwrap.dedent(E2E_WORKER))
    records = tmp_path / "records.jsonl"
    env = base_env(E2E_OUT=str(records), WARM_E2E_MARKER=uuid.uuid4().hex)
    env.setdefault("PYTHONWARNINGS", "ignore:Failed to initialize NumPy:UserWarning")
    if warm_start:
        env["WAIT_FOR_WARM"] = "1"
    flags = ["--warm-modules=json"] if warm_start else ["--no-warm-start"]
    code, out = _etcdrun(tmp_path, flags, env)
    assert code == 0, out[-4000:]
    lines = [json.loads(x) for x in records.read_text().splitlines()]
    by = {(r["attempt"], r["rank"]): r for r in lines}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)], out[-4000:]
    script = str(tmp_path / "worker.py")
    cold_cmdline = [PY, "-u", script]
    for r in lines:
        assert r["orig_argv"] == cold_cmdline and r["argv"] == [script]
    if not warm_start:
        assert all(r["cmdline"] == cold_cmdline for r in lines)
        assert all(r["warm"] == {} for r in lines), "--no-warm-start started warm interpreters"
        return
    # The first attempt is warm too: the pool starts with the agent, which joins its first
    # round once every local worker has a ready interpreter (3396d33).
    for rank in (0, 1):
        first = by[(0, rank)]
        assert first["cmdline"][:3] == [PY, "-u", WARM_PROGRAM], first
        restarted = by[(1, rank)]
        assert restarted["cmdline"][:3] == [PY, "-u", WARM_PROGRAM], restarted
        assert restarted["cmdline"][-1] == "json"
        # The restarted worker is one of the interpreters that were ready for its local
        # rank while the first attempt ran.
        assert restarted["pid"] in by[(0, 1)]["warm"][str(rank)], (restarted, by[(0, 1)])


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
    pool, launch, release = _importing_pool(harness, tmp_path)
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
    pool, launch, release = _importing_pool(harness, tmp_path)
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
        assert _started_cold(harness, pool, launch, killed, tmp_path).returncode == 0
    finally:
        release.write_text("")

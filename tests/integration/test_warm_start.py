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

No etcd is needed. The shared probe and harness are in ``warm_support.py``; the
fallbacks to a cold start are in ``test_warm_fallbacks.py``, the torch cases in
``test_warm_torch.py``, ``etcdrun`` end to end in ``test_warm_etcdrun.py``.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent.workers.group import build_argv
from agent.workers.warm import LATE_KEYS
from tests.integration.warm_support import (
    PY,
    WARM_PROGRAM,
    Harness,
    Run,
    base_env,
    cold_and_warm,
    differences,
    make_launch,
    wait_ready,
    warm_pids,
    write_probe,
)

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

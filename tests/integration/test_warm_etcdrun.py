"""End to end: ``etcdrun --standalone`` restarts a failed worker from a warm interpreter
(and starts none with ``--no-warm-start``); the first attempt is warm too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import textwrap
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from tests.integration.warm_support import (
    PY,
    WARM_PROGRAM,
    alive,
    base_env,
)

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

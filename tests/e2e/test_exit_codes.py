"""etcdrun's exit code for each ending, next to stock torchrun's for the same ending
(docs/user-guide.md, "Exit codes"). Every pair runs at once, with a worker that does not
import torch, so the whole table costs about one agent start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster
from tests.e2e.agents import ETCDRUN, ROOT, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TORCHRUN = Path(sys.executable).with_name("torchrun")

_WORKER = textwrap.dedent(
    """
    import os, sys, time
    open(os.path.join(os.environ["OUT_DIR"], os.environ["TAG"]), "w").close()
    mode = sys.argv[1]
    if mode == "fail":
        sys.exit(3)
    if mode == "sleep":
        time.sleep(120)
    """
)


@dataclass
class Ending:
    """One ending of one launcher."""

    name: str
    argv: list[str]
    signal_when_started: bool = False
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)


def _argv(launcher: str, endpoint: str, run_id: str, script: Path, case: str) -> list[str]:
    exe = str(ETCDRUN if launcher == "etcdrun" else TORCHRUN)
    one = [exe, "--standalone", "--nproc-per-node=1", "--max-restarts=0"]
    if case == "success":
        return [*one, str(script), "ok"]
    if case == "worker failed":
        return [*one, str(script), "fail"]
    if case == "SIGTERM":
        return [*one, str(script), "sleep"]
    if case == "unknown flag":
        return [exe, "--no-such-flag", str(script), "ok"]
    if case == "bad --nnodes":
        return [exe, "--nnodes=4:2", str(script), "ok"]
    # join timeout: 2 nodes wanted, 1 comes (torchrun on our backend through its entry point)
    return [
        exe, "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        "--nnodes=2", "--nproc-per-node=1", "--rdzv-conf=join_timeout=2,last_call_timeout=1",
        str(script), "ok",
    ]  # fmt: skip


# case -> (etcdrun, torchrun 2.13)
EXPECTED = {
    "success": (0, 0),
    "worker failed": (1, 1),
    "SIGTERM": (143, 1),  # torchrun: an uncaught SignalException (a traceback)
    "unknown flag": (2, 2),
    "bad --nnodes": (2, 1),  # torchrun: an AssertionError traceback
    "join timeout": (1, 1),
}


def test_exit_codes_next_to_torchruns(etcd1: EtcdCluster, run_id: str, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    endings: list[Ending] = []
    for case in EXPECTED:
        for launcher in ("etcdrun", "torchrun"):
            rid = f"{run_id}-{launcher}-{case.replace(' ', '-').replace('--', '')}"
            argv = _argv(launcher, etcd1.endpoint_list, rid, script, case)
            endings.append(Ending(f"{launcher}/{case}", argv, case == "SIGTERM"))
    try:
        for i, ending in enumerate(endings):
            ending.log = tmp_path / f"{i}.log"
            env = {**os.environ, "OUT_DIR": str(tmp_path), "TAG": f"started-{i}"}
            with open(ending.log, "wb") as out:
                ending.proc = subprocess.Popen(
                    ending.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
        for i, ending in enumerate(endings):
            if ending.signal_when_started:
                assert ending.proc is not None
                marker = tmp_path / f"started-{i}"
                log = ending.log
                wait_for(f"{ending.name}'s worker", marker.exists, 180, diagnose=log.read_text)
                time.sleep(0.5)  # the agent is in its monitor loop
                ending.proc.send_signal(signal.SIGTERM)
        got = {}
        for ending in endings:
            assert ending.proc is not None
            try:
                got[ending.name] = ending.proc.wait(180)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{ending.name} still runs: {ending.log.read_text()}"
                ) from None
    finally:
        for ending in endings:
            if ending.proc is not None and ending.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(ending.proc.pid, signal.SIGKILL)
                ending.proc.wait(30)
    table = {case: (got[f"etcdrun/{case}"], got[f"torchrun/{case}"]) for case in EXPECTED}
    assert table == EXPECTED, "\n\n".join(
        f"{e.name}: {got.get(e.name)}\n{e.log.read_text()[-1500:]}" for e in endings
    )

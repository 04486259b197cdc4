"""The chaos run's stalled import (tests/chaos/preload/chaos_stall.py) and how the harness
tells a ready warm interpreter, and the local rank it serves, from one still importing or
stuck.

A ready spare was once told by its CPU time alone (none over a second); on a machine
loaded by other jobs an interpreter still importing torch got no CPU for a second, and
an import stuck in an earlier fault uses none, so the harness killed a worker while the
agent had no spare (``warm_import_stuck``: recovery 8.6-16 s, 6 of 60 kills, seed 9 at a
load average of 7-11); and it counted spares for the agent, not per local rank (a spare
serves one local rank), so the last kill found two spares of one rank and none of the
other (7.6 s). Each interpreter that gets past ``chaos_stall`` now marks itself, with its
local rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.faults_edges import _ready_rank
from tests.chaos.fleet import PRELOAD

_WAITS = "import chaos_stall, sys; sys.stdin.read()"  # imports, then waits as a spare does


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait(10)


def _start(tmp_path: Path, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    env = {
        **os.environ, "PYTHONPATH": str(PRELOAD), "CHAOS_STALL_DIR": str(tmp_path),
        "LOCAL_RANK": "1",  # a warm interpreter's template has its worker's local rank
    }  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", _WAITS], stdin=subprocess.PIPE, env=env)
    procs.append(proc)
    return proc


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.02)


def test_an_interpreter_past_its_preload_is_marked_ready_and_the_stuck_one_is_not(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    spare = _start(tmp_path, started)
    deadline = time.monotonic() + 30
    while _ready_rank(tmp_path, spare.pid) != "1":
        assert spare.poll() is None and time.monotonic() < deadline, "the spare was never marked"
        time.sleep(0.02)

    (tmp_path / f"stall-{os.getpid()}").write_text("")  # armed for this process's children
    stuck = _start(tmp_path, started)
    taken = tmp_path / f"stall-{os.getpid()}.taken"
    _wait_for(taken)
    deadline = time.monotonic() + 30
    while taken.read_text() != str(stuck.pid):
        assert time.monotonic() < deadline, "the stuck interpreter never wrote its pid"
        time.sleep(0.02)
    assert stuck.poll() is None  # it hangs
    assert _ready_rank(tmp_path, stuck.pid) is None
    # A mark names the process by its start time too: a pid reused later is not ready.
    os.rename(next(tmp_path.glob(f"ready-{spare.pid}-*")), tmp_path / f"ready-{spare.pid}-1")
    assert _ready_rank(tmp_path, spare.pid) is None


# Imports, forks a copy (as the warm pool refills), and waits; the copy writes its pid.
_FORKS = """
import chaos_stall, os, sys
if os.fork() == 0:
    print(os.getpid(), flush=True)
sys.stdin.read()
"""


def test_a_copy_forked_from_a_marked_interpreter_marks_itself(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    env = {**os.environ, "PYTHONPATH": str(PRELOAD), "CHAOS_STALL_DIR": str(tmp_path),
           "LOCAL_RANK": "1"}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    started.append(proc)
    assert proc.stdout is not None
    copy = int(proc.stdout.readline())
    try:
        assert _ready_rank(tmp_path, proc.pid) == "1"
        assert _ready_rank(tmp_path, copy) == "1"
    finally:
        os.kill(copy, 9)

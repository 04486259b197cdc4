"""What an ``rdzvctl`` command loads before it answers, and how its process ends.

How fast it starts is measured by ``benchmarks/startup.py`` (docs/performance.md), not
here; these tests pin the causes: a command loads neither torch nor python3-etcd3's own
client nor the modules of the commands it does not run, and the console entry turns
the garbage collector back on once its imports are done. Each runs in a fresh
interpreter (``sys.modules`` of this one holds everything the suite imported).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Loaded by no read command: torch, python3-etcd3's client (we use only its generated
# stubs), the state's writer and the commands' own modules (gc, watch, timeline).
NEVER = (
    "torch",
    "matplotlib",
    "etcd3",
    "etcd3.client",
    "coordinator.core.executor",
    "coordinator.rdzvctl.ops",
    "coordinator.rdzvctl.timeline",
)
# The run's timeline (events, and the transitions they name): events and timeline only.
TIMELINE = (
    "coordinator.rdzvctl.history",
    "coordinator.core.events",
    "coordinator.core.transitions",
)
# The watch loop: watch only.
WATCH = "coordinator.rdzvctl.watch"


def _closed_port() -> int:
    # A port nothing listens on: the command connects, is refused, and ends with exit
    # code 3 after loading everything that a command against a live etcd loads.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


@pytest.mark.parametrize(
    ("command", "absent"),
    [
        (["list"], (*NEVER, *TIMELINE, WATCH)),
        (["status", "job"], (*NEVER, *TIMELINE, WATCH)),
        (["events", "job"], (*NEVER, WATCH)),
        (["watch", "job", "--timeout", "1"], (*NEVER, *TIMELINE)),
    ],
    ids=["list", "status", "events", "watch"],
)
def test_a_command_loads_only_what_it_uses(command: list[str], absent: tuple[str, ...]) -> None:
    argv = [*command, f"--endpoints=127.0.0.1:{_closed_port()}", "--read-timeout=0.3"]
    code = (
        "import json, sys\n"
        "from coordinator.rdzvctl import main\n"
        f"exit_code = main({argv!r})\n"
        "print(json.dumps({'code': exit_code,\n"
        "    'client': 'coordinator.core.etcd_client' in sys.modules,\n"
        f"    'loaded': [m for m in {absent!r} if m in sys.modules]}}))\n"
    )
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    # It got as far as etcd (exit code 3: unreachable), so it loaded what a command that
    # reaches etcd loads.
    assert (result["code"], result["client"]) == (3, True), done.stderr
    assert result["loaded"] == []


def test_the_console_entry_exits_with_the_code_and_collects_garbage_again() -> None:
    # program() turns the collector off while the imports run: it must be on again for
    # the command (a watch may run for days), and the exit code must be main()'s.
    argv = ["rdzvctl", "list", f"--endpoints=127.0.0.1:{_closed_port()}", "--read-timeout=0.3"]
    code = (
        "import gc, sys\n"
        f"sys.argv = {argv!r}\n"
        "from coordinator.rdzvctl import program\n"
        "try:\n"
        "    program()\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, gc.isenabled(), gc.get_freeze_count() > 0)\n"
    )
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "True", "True"]
    assert done.stderr.startswith("rdzvctl: error: ")
    assert done.stderr.count("\n") == 1


def test_python_dash_m_is_the_console_entry() -> None:
    argv = ["list", f"--endpoints=127.0.0.1:{_closed_port()}", "--read-timeout=0.3"]
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.rdzvctl", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.startswith("rdzvctl: error: ")
    assert done.stderr.count("\n") == 1


def test_the_etcd_client_loads_etcds_stubs_without_python3_etcd3s_client() -> None:
    code = (
        "import sys\n"
        "import coordinator.core.etcd_client\n"
        "from coordinator.core.etcd_client._etcdrpc import etcdrpc\n"
        "before = 'etcd3' in sys.modules\n"
        "import etcd3.etcdrpc\n"  # a user of python3-etcd3 in the same process
        "print(before, etcd3.etcdrpc.RangeRequest is etcdrpc.RangeRequest,\n"
        "      type(etcd3.client).__name__)\n"
    )
    done = _fresh(code)
    assert done.returncode == 0, done.stderr
    # Not loaded by us; loaded by its own user, with the very message classes we use.
    assert done.stdout.split() == ["False", "True", "function"]

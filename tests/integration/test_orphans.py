"""No orphans (issue 8 item 5), at the level of ``coordinator.core.lifeline``: children
die with a SIGKILLed parent, whichever of its threads started them; the exec trampoline is
invisible to the program (environment, signals, errors as ``Popen`` gives them); the
janitor removes directories after a SIGKILLed parent and never signals a stranger.

Every test runs real processes; a helper process stands in for the agent where the test
must SIGKILL it. Whatever a test starts is SIGKILLed and reaped by that test, even when an
assertion fails (:class:`Tracked`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from coordinator.core.lifeline import Janitor, spawn
from tests.e2e.agents import alive
from tests.integration.orphans_support import Tracked, start_time, wait_gone

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TRAMPOLINE = ROOT / "coordinator" / "core" / "lifeline" / "trampoline.py"
JANITOR = ROOT / "coordinator" / "core" / "lifeline" / "janitor.py"
# A child that ignores SIGTERM and would run for ten minutes.
STUBBORN_CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
)


def helper(tracked: Tracked, body: str) -> tuple[subprocess.Popen[bytes], list[str]]:
    """Run ``body`` in a Python helper process; returns it and the first line it prints
    (split), once it printed it."""
    proc = tracked.popen(
        [sys.executable, "-c", textwrap.dedent(body)], cwd=ROOT, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line, f"helper exited with {proc.wait(30)} before reporting"
    return proc, line.split()


SPAWN_AND_WAIT = f"""
    import subprocess, sys, time
    from coordinator.core.lifeline import spawn
    argv = [sys.executable, "-c", {STUBBORN_CHILD!r}]
    if sys.argv[1] == "lifeline":
        child = spawn(argv, start_new_session=True).confirm()
    else:
        child = subprocess.Popen(argv, start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["lifeline", "plain Popen"])
def test_children_of_a_sigkilled_parent(how: str, tracked: Tracked) -> None:
    """Through the lifeline the child (in its own session, ignoring SIGTERM) dies with
    its parent; through plain Popen it survives, which is what the lifeline is for."""
    proc = tracked.popen(
        [sys.executable, "-c", textwrap.dedent(SPAWN_AND_WAIT), how],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    child = tracked.add(int(proc.stdout.readline()))
    assert alive(child)
    proc.kill()
    proc.wait(30)
    if how == "lifeline":
        print(f"parent SIGKILL -> child gone: {wait_gone([child]) * 1000:.1f} ms")
    else:
        time.sleep(1.0)  # the negative control: give a death signal time to arrive
        assert alive(child)


def test_a_child_started_from_a_thread_that_ends_lives_on(tracked: Tracked) -> None:
    """The parent-death signal follows the forking thread: the lifeline forks on its own
    long-lived thread, so a caller's thread may end (the control, in a helper process,
    shows that a child forked by such a thread itself dies with it)."""
    box: list[subprocess.Popen[bytes]] = []
    thread = threading.Thread(target=lambda: box.append(spawn(["sleep", "600"]).confirm()))
    thread.start()
    thread.join()
    child = box[0]
    tracked.popens.append(child)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=1.0)

    _, (control,) = helper(tracked, """
        import ctypes, subprocess, threading, time
        def arm() -> None:
            ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
        box = []
        t = threading.Thread(target=lambda: box.append(
            subprocess.Popen(["sleep", "600"], preexec_fn=arm)))
        t.start(); t.join()
        print(box[0].pid, flush=True)
        time.sleep(600)
    """)  # fmt: skip
    tracked.add(int(control))
    wait_gone([int(control)])


def test_trampoline_does_not_start_the_program_when_its_parent_is_gone(tmp_path: Path) -> None:
    """The race: the parent died between fork and prctl. The trampoline, told a parent pid
    that is not its parent's, must not run the program, and ends by the death signal."""
    marker = tmp_path / "ran"
    program = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    for parent, expected in ((1, -signal.SIGKILL), (os.getpid(), 0)):
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-S", "-I", str(TRAMPOLINE), str(parent), str(write_fd),
                 str(int(signal.SIGKILL)), "-", *program],
                pass_fds=(write_fd,),
            )  # fmt: skip
            os.close(write_fd)
            assert proc.wait(60) == expected
            assert os.read(read_fd, 100) == b""  # nothing to report: no exec was tried
        finally:
            os.close(read_fd)
        assert marker.exists() is (expected == 0)


def test_exec_errors_are_popens(tmp_path: Path) -> None:
    plain = tmp_path / "plain.txt"
    plain.write_text("not a program")
    for argv, kind, text in (
        (["/nonexistent/prog"], FileNotFoundError, "No such file or directory"),
        (["no-such-program-anywhere"], FileNotFoundError, "No such file or directory"),
        ([str(plain)], PermissionError, "Permission denied"),
    ):
        spawned = spawn(argv)
        with pytest.raises(kind) as err:
            spawned.confirm()
        assert (err.value.strerror, err.value.filename) == (text, argv[0])
        assert spawned.process.returncode == 127  # reaped by confirm()
        with pytest.raises(kind) as direct:
            subprocess.Popen(argv)
        assert direct.value.strerror == text


def test_a_refused_death_signal_is_a_clear_error() -> None:
    spawned = spawn(["true"], death_signal=1000)
    with pytest.raises(OSError, match=r"^\[Errno 22\] prctl\(PR_SET_PDEATHSIG\) failed: "
                       r"Invalid argument: 'true'$"):  # fmt: skip
        spawned.confirm()


def test_the_program_sees_what_popen_would_give_it() -> None:
    """Same environment (the trampoline's own locale coercion, PEP 538, adds no LC_CTYPE
    and changes none; a shell shows it, as a Python probe would coerce too), same ignored
    and blocked signals; and the death signal is armed."""
    probe = ["sh", "-c", "env | sort; grep -E '^Sig(Ign|Blk)' /proc/self/status"]
    for env in (
        {"PATH": os.environ["PATH"], "LANG": "C", "X": "\u00fc y"},
        {"PATH": os.environ["PATH"], "LC_CTYPE": "C", "LC_ALL": ""},
    ):
        spawned = spawn(probe, env=env, stdout=subprocess.PIPE)
        out, _ = spawned.confirm().communicate(timeout=60)
        reference = subprocess.run(probe, env=env, capture_output=True, check=True, timeout=60)
        assert out.decode() == reference.stdout.decode()
        assert ("LC_CTYPE=C\n" in out.decode()) is ("LC_CTYPE" in env)
    get = (  # PR_GET_PDEATHSIG
        "import ctypes; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "
        "print(v.value)"
    )
    spawned = spawn([sys.executable, "-c", get], stdout=subprocess.PIPE)
    assert int(spawned.confirm().communicate(timeout=60)[0]) == signal.SIGKILL


JANITOR_HELPER = """
    import sys, time
    from pathlib import Path
    from coordinator.core.lifeline import Janitor, spawn
    data = Path(sys.argv[1])
    janitor = Janitor([data])
    janitor.start()
    child = spawn(["sleep", "600"], cwd=str(data)).process
    janitor.watch(child)
    print(child.pid, janitor.pid, flush=True)
    time.sleep(600)
"""


def test_janitor_removes_the_directory_after_a_sigkilled_parent(
    tmp_path: Path, tracked: Tracked
) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "sub" / "file").write_text("x")
    proc = tracked.popen(
        [sys.executable, "-c", textwrap.dedent(JANITOR_HELPER), str(data)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    child, janitor = (tracked.add(int(p)) for p in proc.stdout.readline().split())
    proc.kill()
    proc.wait(30)
    took = wait_gone([child, janitor])
    print(f"parent SIGKILL -> child and janitor gone: {took * 1000:.1f} ms")
    assert not data.exists()


def test_janitor_close_removes_and_reaps(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    janitor = Janitor([data])
    assert janitor.start()
    pid = janitor.pid
    assert pid is not None
    child = spawn(["true"]).confirm()
    janitor.watch(child)
    child.wait(30)
    janitor.close()
    assert not data.exists()
    assert not alive(pid)
    janitor.close()  # idempotent


def test_janitor_never_signals_a_process_it_does_not_know(tmp_path: Path, tracked: Tracked) -> None:
    """A watched pid whose start time differs (the pid was reused) is left alone."""
    data = tmp_path / "data"
    data.mkdir()
    bystander = tracked.popen(["sleep", "600"])
    start = start_time(bystander.pid)
    assert start is not None
    proc = subprocess.run(
        [sys.executable, "-S", "-I", str(JANITOR), str(data)],
        input=f"{bystander.pid} {start + 1}\n".encode(),
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert not data.exists()
    assert bystander.poll() is None

"""Signals become stop requests on a watcher thread, never exceptions in the main thread.

A child process installs :func:`agent.loop.stopping.stop_requests` and then holds a lock in a
busy loop (the worst place for a Python signal handler that would take that lock or
raise); SIGTERM must reach ``on_stop`` on another thread, the main thread must see only
the flag, and on exit the previous handler must be back.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

CHILD = """
    import signal, sys, threading, time
    from agent.loop.stopping import stop_requests

    requested = []
    lock = threading.Lock()

    def on_stop(signum):
        # Would deadlock if called from a signal handler while the main thread holds it.
        with lock:
            requested.append((signum, threading.current_thread().name))

    with stop_requests(on_stop):
        print("ready", flush=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                if requested:
                    break
                sum(range(1000))  # hold the lock while signals arrive
        print(f"requested {requested}", flush=True)
    print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
"""


def _run(signum: signal.Signals) -> list[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    return out.splitlines()


def test_sigterm_becomes_a_request_on_the_watcher_thread() -> None:
    assert _run(signal.SIGTERM) == ["requested [(15, 'stop-requests')]", "restored True"]


def test_sigint_raises_no_keyboard_interrupt() -> None:
    assert _run(signal.SIGINT)[0] == "requested [(2, 'stop-requests')]"

"""The embedded etcd of ``--standalone``: healthy inside the block, gone after it (process
reaped, data directory removed) on every way out, signal handlers restored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.request
from pathlib import Path

import pytest

from agent.cli import standalone
from agent.cli.standalone import embedded_etcd
from coordinator.etcd_server import EtcdCluster

pytestmark = pytest.mark.integration


class _Spy:
    """Remembers the clusters ``embedded_etcd`` creates, so the test can look at them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.clusters: list[EtcdCluster] = []
        real = standalone.EtcdCluster

        def make(*args: object, **kwargs: object) -> EtcdCluster:
            cluster = real(*args, **kwargs)  # type: ignore[arg-type]
            self.clusters.append(cluster)
            return cluster

        monkeypatch.setattr(standalone, "EtcdCluster", make)

    def assert_gone(self) -> None:
        assert len(self.clusters) == 1
        cluster = self.clusters[0]
        member = cluster.members[0]
        assert member.process is not None and member.process.returncode is not None
        assert not member.running
        assert not cluster.base_dir.exists()


def _healthy(endpoint: str) -> bool:
    with urllib.request.urlopen(f"http://{endpoint}/health", timeout=5) as rsp:
        return b'"true"' in rsp.read()


def test_member_is_healthy_inside_and_gone_after(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with embedded_etcd() as endpoint:
        host, port = endpoint.split(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert _healthy(endpoint)
        assert spy.clusters[0].members[0].data_dir.exists()
    spy.assert_gone()
    assert {s: signal.getsignal(s) for s in before} == before


def test_member_is_gone_after_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    with pytest.raises(RuntimeError, match="boom"), embedded_etcd() as endpoint:
        assert _healthy(endpoint)
        raise RuntimeError("boom")
    spy.assert_gone()


def test_sigterm_inside_the_block_raises_system_exit_and_cleans_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy(monkeypatch)
    with pytest.raises(SystemExit) as info, embedded_etcd():
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Event().wait(30)  # the handler raises before this returns
    assert info.value.code == 128 + signal.SIGTERM
    spy.assert_gone()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_a_process_holding_the_block_removes_etcd(signum: int, tmp_path: Path) -> None:
    """A real process gets the signal while inside the block: etcd must not outlive it."""
    report = tmp_path / "state"
    program = textwrap.dedent(
        f"""
        import sys, threading
        from pathlib import Path
        from agent.cli import standalone

        clusters = []
        real = standalone.EtcdCluster
        def make(*args, **kwargs):
            clusters.append(real(*args, **kwargs))
            return clusters[-1]
        standalone.EtcdCluster = make
        try:
            with standalone.embedded_etcd():
                pid = clusters[0].members[0].process.pid
                Path({str(report)!r}).write_text(f"{{pid}} {{clusters[0].base_dir}}")
                print("ready", flush=True)
                threading.Event().wait(120)
        except KeyboardInterrupt:
            sys.exit(130)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", program],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        pid_text, base_dir = report.read_text().split(" ", 1)
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signum
    assert not Path(base_dir).exists()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_text), 0)

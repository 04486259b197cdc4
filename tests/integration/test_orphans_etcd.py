"""No orphans (issue 8 item 5) for the etcd processes of ``EtcdCluster`` (tests, benchmarks,
``--standalone``): they do not outlive a SIGKILLed owner, and their data goes too; while the
owner lives, ``kill`` and ``restart`` keep their meaning, from any thread."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster
from tests.e2e.agents import ROOT, alive
from tests.integration.orphans_support import Tracked, wait_gone

pytestmark = pytest.mark.integration


OWNER = """
    import sys, time
    from pathlib import Path
    from coordinator.etcd_server import EtcdCluster
    cluster = EtcdCluster(3, binary=Path(sys.argv[1]), no_fsync=True, stop_grace=1.0).start()
    print(cluster.base_dir, *(m.process.pid for m in cluster.members), flush=True)
    time.sleep(600)
"""


def test_a_sigkilled_owner_takes_its_members_and_their_data(
    tracked: Tracked, etcd_binary: Path
) -> None:
    owner = tracked.popen(
        [sys.executable, "-c", textwrap.dedent(OWNER), str(etcd_binary)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    assert owner.stdout is not None
    base_dir, *pids = owner.stdout.readline().decode().split()
    members = [tracked.add(int(p)) for p in pids]
    assert len(members) == 3 and all(alive(p) for p in members)
    assert Path(base_dir, "m0").is_dir()
    owner.kill()
    killed_at = time.monotonic()
    owner.wait(30)
    wait_gone(members)
    print(f"\nowner SIGKILL -> 3 etcd members gone: {time.monotonic() - killed_at:.3f} s")
    deadline = time.monotonic() + 5
    while Path(base_dir).exists():
        assert time.monotonic() < deadline, f"{base_dir} still there 5 s after the owner died"
        time.sleep(0.02)


def test_kill_and_restart_from_a_thread_that_ends(tmp_path: Path, etcd_binary: Path) -> None:
    """kill() keeps the data, restart() brings the member back with it; a member
    restarted by a short-lived thread survives that thread (its death signal is tied to
    the lifeline's own thread, not the caller's)."""
    with EtcdCluster(1, binary=etcd_binary, no_fsync=True, stop_grace=1.0) as cluster:
        member = cluster.members[0]
        wal = member.data_dir / "member" / "wal"
        assert wal.is_dir()
        cluster.kill(0)
        assert not member.running
        assert wal.is_dir()
        thread = threading.Thread(target=cluster.restart, args=(0,))
        thread.start()
        thread.join()
        assert member.running and member.healthy(timeout=5)
        process = member.process
        assert process is not None
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)  # it would die now if tied to the ended thread
        assert member.healthy(timeout=5)
    assert not member.running
    assert not cluster.base_dir.exists()

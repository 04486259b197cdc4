"""No worker of any attempt waits on a port nobody listens on (issue 10, item 3): the
agent of group rank 0 hosts the workers' bootstrap store before any worker starts.

The worker's first act is a plain TCP connect to MASTER_ADDR:MASTER_PORT, before
``init_process_group``. Local rank 0 sleeps first: were the store hosted by rank 0's
worker (torch's default without an agent store), rank 1 would find nobody listening.
Rank 1 fails its first attempt, so the second attempt (new round, new server) is checked
too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = """
    import json, os, socket, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist

    out, rank = sys.argv[1], int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank == 0:
        time.sleep(1.0)  # a worker-hosted store would not be up for rank 1 yet
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        socket.create_connection((addr, port), timeout=2).close()
        listening = True
    except OSError:
        listening = False
    record = {"rank": rank, "attempt": attempt, "listening": listening, "port": port,
              "agent_store": os.environ["TORCHELASTIC_USE_AGENT_STORE"]}
    with open(f"{out}/r{rank}-a{attempt}.json", "w") as f:
        json.dump(record, f)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(1))
    if rank == 1 and attempt == 0:
        sys.exit(1)  # one counted restart: the next attempt is checked too
    dist.destroy_process_group()
"""


def _etcdrun(args: list[str], timeout: float) -> tuple[int, str]:
    """``etcdrun --standalone`` with two workers per node; its exit code and output."""
    argv = [
        sys.executable, "-m", "agent", "--standalone", "--nproc-per-node=2",
        "--monitor-interval=0.1", *args,
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out


def test_every_worker_of_every_attempt_finds_the_bootstrap_store_listening(
    tmp_path: Path,
) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    code, out = _etcdrun(["--max-restarts=1", str(script), str(tmp_path)], 120)
    assert code == 0, out
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("r*-a*.json"))]
    assert sorted((r["rank"], r["attempt"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["listening"] for r in records), records
    assert all(r["agent_store"] == "True" for r in records)
    ports = {r["attempt"]: r["port"] for r in records}
    assert ports[0] != ports[1]  # one server per round


def test_a_fixed_master_port_survives_every_restart(tmp_path: Path) -> None:
    # torchrun's habit: --master-port. The next round forms while the last one's server
    # may still hold that port; group rank 0's agent exited 1 with EADDRINUSE at the
    # first restart. Two restarts here (rank 1 fails attempts 0 and 1).
    from coordinator.core.ports import free_port

    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER).replace("attempt == 0", "attempt < 2"))
    port = free_port("127.0.0.1")
    flags = ["--max-restarts=2", f"--master-port={port}", "--master-addr=127.0.0.1"]
    code, out = _etcdrun([*flags, str(script), str(tmp_path)], 180)
    assert code == 0, out
    assert "EADDRINUSE" not in out
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("r*-a*.json"))]
    assert sorted((r["attempt"], r["rank"]) for r in records) == [
        (a, r) for a in range(3) for r in range(2)
    ]
    assert {r["port"] for r in records} == {port}
    assert all(r["listening"] for r in records), records

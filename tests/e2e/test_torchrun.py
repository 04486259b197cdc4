"""Stock torchrun uses our rendezvous through the ``torchrun.handlers`` entry point."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coordinator.etcd_server import EtcdCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_WORKER = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, (t.item(), expected)
    with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}"), "w") as f:
        f.write(f"{world} {t.item()} {os.environ['GROUP_RANK']} {os.environ['LOCAL_RANK']}")
    dist.destroy_process_group()
    """
)


def test_two_stock_torchruns_all_reduce_over_etcd_v3(
    etcd3: EtcdCluster, run_id: str, tmp_path: Path
) -> None:
    script = tmp_path / "allreduce.py"
    script.write_text(_WORKER)
    torchrun = Path(sys.executable).with_name("torchrun")
    argv = [
        str(torchrun),
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={etcd3.endpoint_list}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=last_call_timeout=1,lease_ttl=3",
        "--nnodes=2",
        "--nproc-per-node=2",
        "--max-restarts=0",
        str(script),
    ]
    env = {**os.environ, "OUT_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=180)
            outputs.append(out)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for proc, out in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, out[-3000:]
    results = sorted((tmp_path / f"rank{r}").read_text().split() for r in range(4))
    assert [r[:2] for r in results] == [["4", "10.0"]] * 4
    assert sorted((r[2], r[3]) for r in results) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]

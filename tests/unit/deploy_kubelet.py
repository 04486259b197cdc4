"""What a kubelet and the training operators make of a container in deploy/kubernetes.

Enough of each to run a manifest's command the way a node would, without a cluster:

* the kubelet: ``envFrom`` first, then ``env`` in order, each ``value`` expanded with the
  variables defined before it (``$(VAR)``; ``$$`` is a literal ``$``; an unknown
  reference stays as written), ``fieldRef`` from the pod's metadata, ``configMapKeyRef``
  from given ConfigMaps; then ``command`` + ``args`` expanded with the final environment.
* Kubeflow Trainer v2's torch plugin (``pkg/runtime/framework/plugins/torch``): the
  TrainJob's ``trainer.env`` merged into the container named ``node``, then PET_NNODES,
  PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT set (replacing a
  variable of the same name); ``trainer.command``/``args`` replace the runtime's.
* the Training Operator v1 (``pkg/controller.v1/pytorch``, ``elastic.go``): the
  variables it appends from ``elasticPolicy``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "command_line",
    "expand",
    "pytorchjob_env",
    "resolve_env",
    "trainer_container",
]

_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD = re.compile(r"metadata\.(labels|annotations)\['([^']+)'\]")
_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of one string."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REFERENCE.sub(one, text)


def _field(path: str, pod: Mapping[str, Any]) -> str:
    metadata = pod["metadata"]
    if path in ("metadata.name", "metadata.namespace"):
        return str(metadata[path.split(".")[1]])
    found = _FIELD.fullmatch(path)
    if found is None:
        raise ValueError(f"fieldRef {path!r} is not modelled here")
    return str(metadata.get(found.group(1), {})[found.group(2)])


def resolve_env(
    container: Mapping[str, Any],
    pod: Mapping[str, Any],
    config_maps: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, str]:
    """The environment a container starts with (without the image's and the services')."""
    config_maps = config_maps or {}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[var["name"]] = _field(source["fieldRef"]["fieldPath"], pod)
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            raise ValueError(f"env {var['name']}: source {sorted(source)} is not modelled here")
    return env


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` as the container runs them."""
    return [expand(part, env) for part in [*container.get("command", []), *container["args"]]]


def _upsert(env: list[dict[str, Any]], var: dict[str, Any]) -> None:
    for index, existing in enumerate(env):
        if existing["name"] == var["name"]:
            env[index] = var
            return
    env.append(var)


def trainer_container(runtime: Mapping[str, Any], train_job: Mapping[str, Any]) -> dict[str, Any]:
    """The ``node`` container of a TrainJob's pods, as the Trainer's torch plugin makes it."""
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    ancestor = "trainer.kubeflow.org/trainjob-ancestor-step"
    (job,) = [j for j in jobs if j["template"]["metadata"]["labels"].get(ancestor) == "trainer"]
    containers = job["template"]["spec"]["template"]["spec"]["containers"]
    (node,) = [c for c in containers if c["name"] == "node"]
    container: dict[str, Any] = {**node, "env": [dict(v) for v in node.get("env", [])]}
    trainer = train_job["spec"].get("trainer", {})
    policy = runtime["spec"]["mlPolicy"]
    for key in ("command", "args", "image"):
        if trainer.get(key):
            container[key] = trainer[key]
    for var in trainer.get("env", []):
        _upsert(container["env"], dict(var))
    name = train_job["metadata"]["name"]
    injected: list[dict[str, Any]] = [
        {"name": "PET_NNODES", "value": str(trainer.get("numNodes", policy.get("numNodes", 1)))},
        {
            "name": "PET_NPROC_PER_NODE",
            "value": str(trainer.get("numProcPerNode", policy["torch"].get("numProcPerNode"))),
        },
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": _COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": "29500"},
    ]
    for var in injected:
        _upsert(container["env"], var)
    return container


def pytorchjob_env(job: Mapping[str, Any]) -> list[dict[str, str]]:
    """The variables the Training Operator appends to a PyTorchJob's containers."""
    policy = job["spec"]["elasticPolicy"]
    workers = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    if "minReplicas" in policy or "maxReplicas" in policy:
        nnodes = f"{policy['minReplicas']}:{policy['maxReplicas']}"
    else:
        nnodes = str(workers["replicas"])
    env = [
        {"name": "PYTHONUNBUFFERED", "value": "0"},
        {"name": "PET_RDZV_ENDPOINT", "value": f"{policy['rdzvHost']}:{policy['rdzvPort']}"},
        {"name": "PET_RDZV_BACKEND", "value": policy.get("rdzvBackend", "c10d")},
        {"name": "PET_NNODES", "value": nnodes},
    ]
    optional = [
        ("maxRestarts", "PET_MAX_RESTARTS"),
        ("nProcPerNode", "PET_NPROC_PER_NODE"),
        ("rdzvId", "PET_RDZV_ID"),
    ]
    env += [{"name": var, "value": str(policy[key])} for key, var in optional if key in policy]
    if policy.get("rdzvConf"):
        conf = ",".join(f"{item['key']}={item['value']}" for item in policy["rdzvConf"])
        env.append({"name": "PET_RDZV_CONF", "value": conf})
    return env

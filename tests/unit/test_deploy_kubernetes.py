"""deploy/kubernetes, checked without a cluster: every document against its schema
(tests/unit/deploy_schemas.py: Kubernetes' own for core kinds, ours for the custom
resources, with their pod and Job templates checked as core types), broken copies
refused, and the names, labels and ports that tie the manifests together."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.unit.deploy_kubelet import resolve_env
from tests.unit.deploy_schemas import SchemaMissingError, validate

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
Doc = dict[str, Any]


def _documents() -> list[tuple[str, Doc]]:
    found = []
    for path in sorted(ROOT.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                where = f"{path.relative_to(ROOT)}:{doc['kind']}:{doc['metadata']['name']}"
                found.append((where, doc))
    return found


DOCUMENTS = _documents()


def _one(kind: str, name: str | None = None, file: str | None = None) -> Doc:
    """A fresh copy of the one document of that kind (and name, and file)."""
    found = [
        doc
        for where, doc in DOCUMENTS
        if doc["kind"] == kind
        and (name is None or doc["metadata"]["name"] == name)
        and (file is None or where.startswith(file + ":"))
    ]
    assert len(found) == 1, f"{len(found)} documents of kind {kind} named {name} in {file}"
    return copy.deepcopy(found[0])


def _pod_spec(doc: Doc) -> Doc:
    if doc["kind"] == "ClusterTrainingRuntime":
        job = doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]
        spec: Doc = job["spec"]["template"]["spec"]
    elif doc["kind"] == "PyTorchJob":
        spec = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    else:
        spec = doc["spec"]["template"]["spec"]
    return spec


def _pod_labels(doc: Doc) -> dict[str, str]:
    if doc["kind"] == "ClusterTrainingRuntime":
        job = doc["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]
        labels: dict[str, str] = job["spec"]["template"]["metadata"]["labels"]
    elif doc["kind"] == "PyTorchJob":
        labels = doc["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"]
    else:
        labels = doc["spec"]["template"]["metadata"]["labels"]
    return labels


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def test_the_folder_has_what_the_deployment_needs() -> None:
    kinds = sorted({(doc["apiVersion"], doc["kind"]) for _, doc in DOCUMENTS})
    assert kinds == [
        ("apps/v1", "StatefulSet"),
        ("batch/v1", "Job"),
        ("kubeflow.org/v1", "PyTorchJob"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("networking.k8s.io/v1", "NetworkPolicy"),
        ("policy/v1", "PodDisruptionBudget"),
        ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
        ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        ("v1", "ConfigMap"),
        ("v1", "Namespace"),
        ("v1", "Service"),
    ]


@pytest.mark.parametrize("doc", [doc for _, doc in DOCUMENTS], ids=[w for w, _ in DOCUMENTS])
def test_every_document_matches_its_schema(doc: Doc) -> None:
    validate(doc)


def _set(path: str, value: Any) -> Callable[[Doc], None]:
    """A mutation that sets one field, the path in dots (numbers index lists)."""

    def mutate(doc: Doc) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = doc
        for part in parents:
            node = node[part]
        node[last] = value

    return mutate


def _rename(path: str, new: str) -> Callable[[Doc], None]:
    def mutate(doc: Doc) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[new] = node.pop(last)

    return mutate


_RUNTIME_POD = "spec.template.spec.replicatedJobs.0.template.spec.template.spec"
_WORKER = "spec.pytorchReplicaSpecs.Worker"

BROKEN: list[tuple[str, str, Callable[[Doc], None], str]] = [
    ("StatefulSet", "", _set("spec.replicas", "three"), "'three' is not of type 'integer'"),
    (
        "StatefulSet",
        "",
        _rename("spec.template.spec.containers.0.env", "environment"),
        "Additional properties are not allowed ('environment' was unexpected)",
    ),
    ("Service", "etcd", _set("spec.ports.0.port", "2379"), "'2379' is not of type 'integer'"),
    (
        "Job",
        "",
        _set("spec.template.spec.initContainers.1.command", "etcdctl user add root"),
        "is not of type 'array'",
    ),
    (
        "ClusterTrainingRuntime",
        "",
        _set("spec.mlPolicy.torch.numProcPerNode", "many"),
        "'many' is not valid under any of the given schemas",
    ),
    (
        "ClusterTrainingRuntime",
        "",
        _set("spec.mlPolicy.mpi", {"numProcPerNode": 1}),
        "should not be valid under",
    ),
    (
        "ClusterTrainingRuntime",
        "",
        _set(f"{_RUNTIME_POD}.containers.0.env.0", {"value": "job42"}),
        "'name' is a required property",
    ),
    (
        "ClusterTrainingRuntime",
        "",
        _set(
            "spec.template.spec.replicatedJobs.0.template.spec.podFailurePolicy.rules.0"
            ".onExitCodes.values",
            [1, "2"],
        ),
        "'2' is not of type 'integer'",
    ),
    ("TrainJob", "", _set("metadata.name", "Job_42"), "does not match"),
    ("TrainJob", "", _set("spec.trainer.numProcPerNode", 0), "0 is less than the minimum of 1"),
    (
        "PyTorchJob",
        "",
        _set("spec.elasticPolicy.rdzvBackend", "zookeeper"),
        "'zookeeper' is not one of ['c10d', 'etcd', 'etcd-v2']",
    ),
    ("PyTorchJob", "", _rename(_WORKER, "Chief"), "'Chief' is not one of ['Master', 'Worker']"),
    (
        "PyTorchJob",
        "",
        _rename(f"{_WORKER}.template.spec.containers", "container"),
        "'containers' is a required property",
    ),
    (
        "ServiceMonitor",
        "etcd-elastic-agents",
        _set("spec.endpoints.0.interval", "15 seconds"),
        "'15 seconds' does not match",
    ),
    (
        "ServiceMonitor",
        "etcd-elastic-etcd",
        lambda doc: doc["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/name": 1}),
        "1 is not of type 'string'",
    ),
]


@pytest.mark.parametrize(
    ("kind", "name", "mutate", "message"),
    BROKEN,
    ids=[f"{kind}-{i}" for i, (kind, *_) in enumerate(BROKEN)],
)
def test_a_broken_document_is_refused(
    kind: str, name: str, mutate: Callable[[Doc], None], message: str
) -> None:
    doc = _one(kind, name or None)
    validate(doc)
    mutate(doc)

    with pytest.raises(jsonschema.ValidationError) as refused:
        validate(doc)
    assert message in refused.value.message


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(SchemaMissingError, match=r"no schema for apiVersion 'kubeflow\.org/v1' "):
        validate({"apiVersion": "kubeflow.org/v1", "kind": "MXJob", "metadata": {"name": "x"}})


def _members() -> list[str]:
    sts = _one("StatefulSet", "etcd")
    service = _one("Service", sts["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    namespace = sts["metadata"]["namespace"]
    return [
        f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}.{namespace}.svc"
        for i in range(sts["spec"]["replicas"])
    ]


def test_every_client_names_the_members_the_statefulset_creates() -> None:
    members = _members()
    assert len(members) == 3
    container = _pod_spec(_one("ClusterTrainingRuntime"))["containers"][0]
    endpoint = [flag for flag in container["command"] if flag.startswith("--rdzv-endpoint=")]
    assert endpoint == ["--rdzv-endpoint=" + ",".join(f"{m}:2379" for m in members)]
    job = _one("Job", "etcd-auth-setup")
    for step in job["spec"]["template"]["spec"]["initContainers"]:
        env = {var["name"]: var["value"] for var in step["env"]}
        assert env["ETCDCTL_ENDPOINTS"] == ",".join(f"https://{m}:2379" for m in members)
    client = _one("Service", "etcd-client")
    policy = _one("PyTorchJob")["spec"]["elasticPolicy"]
    assert policy["rdzvHost"] == f"etcd-client.{client['metadata']['namespace']}.svc"
    assert policy["rdzvPort"] == client["spec"]["ports"][0]["port"] == 2379


@pytest.mark.parametrize("config", ["config-plain.yaml", "config-tls.yaml"])
def test_each_etcd_config_gives_every_member_its_own_urls(config: str) -> None:
    sts = _one("StatefulSet", "etcd")
    config_map = _one("ConfigMap", "etcd-config", f"etcd/{config}")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    scheme = config_map["data"]["CLIENT_SCHEME"]
    assert scheme == config_map["data"]["PEER_SCHEME"] == ("https" if "tls" in config else "http")
    members = _members()
    peers = ",".join(f"{m.split('.')[0]}={scheme}://{m}:2380" for m in members)
    for index, member in enumerate(members):
        pod = {"metadata": {"name": f"etcd-{index}", "namespace": "etcd-elastic"}}
        env = resolve_env(container, pod, {"etcd-config": config_map["data"]})
        assert not [value for value in env.values() if "$(" in value]
        assert env["ETCD_NAME"] == f"etcd-{index}"
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"{scheme}://{member}:2379"
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"{scheme}://{member}:2380"
        assert env["ETCD_INITIAL_CLUSTER"] == peers
    # The TLS files are where the Secret is mounted.
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    files = [v for k, v in config_map["data"].items() if k.endswith("_FILE")]
    assert all(f.startswith(mounts["tls"] + "/") for f in files)
    assert len(files) == (6 if "tls" in config else 0)


def test_services_and_monitors_select_what_they_serve() -> None:
    etcd_pods = _pod_labels(_one("StatefulSet", "etcd"))
    agent_pods = [_pod_labels(_one("ClusterTrainingRuntime")), _pod_labels(_one("PyTorchJob"))]
    for name in ("etcd", "etcd-client"):
        assert _selects(_one("Service", name)["spec"]["selector"], etcd_pods)
    metrics = _one("Service", "etcd-elastic-agents")
    assert all(_selects(metrics["spec"]["selector"], labels) for labels in agent_pods)
    assert not _selects(metrics["spec"]["selector"], etcd_pods)
    services = [doc for _, doc in DOCUMENTS if doc["kind"] == "Service"]
    monitored = {"etcd-elastic-agents": [metrics], "etcd-elastic-etcd": [_one("Service", "etcd")]}
    for monitor_name, expected in monitored.items():
        selector = _one("ServiceMonitor", monitor_name)["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services if _selects(selector, s["metadata"]["labels"])]
        # One Service each: a second one would scrape every target twice.
        assert chosen == expected
        ports = {p["name"] for p in chosen[0]["spec"]["ports"]}
        endpoints = _one("ServiceMonitor", monitor_name)["spec"]["endpoints"]
        assert {e["port"] for e in endpoints} <= ports
    # Every named targetPort is a port of the pods behind it.
    backends = [
        (metrics, [_one("ClusterTrainingRuntime"), _one("PyTorchJob")]),
        (_one("Service", "etcd"), [_one("StatefulSet", "etcd")]),
    ]
    for service, pods in backends:
        for pod in pods:
            names = {p["name"] for c in _pod_spec(pod)["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_etcd_lets_in_its_members_and_the_agents_and_keeps_quorum_in_a_drain() -> None:
    etcd_pods = _pod_labels(_one("StatefulSet", "etcd"))
    policy = _one("NetworkPolicy", "etcd")["spec"]
    assert _selects(policy["podSelector"]["matchLabels"], etcd_pods)
    by_port = {rule["ports"][0]["port"]: rule.get("from") for rule in policy["ingress"]}
    assert _selects(by_port[2380][0]["podSelector"]["matchLabels"], etcd_pods)
    clients = by_port[2379][0]["podSelector"]["matchLabels"]
    auth_job = _one("Job", "etcd-auth-setup")["spec"]["template"]["metadata"]["labels"]
    for labels in (
        _pod_labels(_one("ClusterTrainingRuntime")),
        _pod_labels(_one("PyTorchJob")),
        auth_job,
    ):
        assert _selects(clients, labels)
    assert by_port[2381] is None  # probes and Prometheus
    budget = _one("PodDisruptionBudget", "etcd")["spec"]
    assert budget["maxUnavailable"] == 1 and _selects(budget["selector"]["matchLabels"], etcd_pods)


def test_the_runtime_has_what_the_trainer_and_etcdrun_expect() -> None:
    runtime = _one("ClusterTrainingRuntime")
    (job,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert job["template"]["metadata"]["labels"] == {
        "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"
    }
    pod = job["template"]["spec"]["template"]["spec"]
    (node,) = pod["containers"]
    assert node["name"] == "node"
    # A pod failure policy needs restartPolicy Never; it ends the job on etcdrun's final
    # exit codes (1: the job failed, 2: a bad command line), and a disruption costs nothing.
    assert pod["restartPolicy"] == "Never"
    fail, ignore = job["template"]["spec"]["podFailurePolicy"]["rules"]
    assert fail == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "node", "operator": "In", "values": [1, 2]},
    }
    assert ignore["action"] == "Ignore"
    assert ignore["onPodConditions"][0]["type"] == "DisruptionTarget"
    run_id = [v for v in node["env"] if v["name"] == "PET_RDZV_ID"]
    assert run_id == [
        {
            "name": "PET_RDZV_ID",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"}
            },
        }
    ]
    train_job = _one("TrainJob")
    assert train_job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]


def test_the_pytorchjob_has_what_the_operator_and_etcdrun_expect() -> None:
    job = _one("PyTorchJob")
    policy = job["spec"]["elasticPolicy"]
    assert policy["rdzvBackend"] == "etcd-v2"
    # Without an id a job of more than one node is refused (docs/user-guide.md, "Run lifecycle").
    assert policy["rdzvId"] == job["metadata"]["name"]
    assert "standalone" not in policy
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert policy["maxReplicas"] == worker["replicas"] >= policy["minReplicas"]
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    # The operator's ExitCode policy: 1-127 final (etcdrun's 1 and 2), 128+ retried.
    assert worker["restartPolicy"] == "ExitCode"
    (container,) = worker["template"]["spec"]["containers"]
    assert container["name"] == "pytorch" and container["command"] == ["etcdrun"]

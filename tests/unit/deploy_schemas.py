"""Schemas for the manifests in deploy/kubernetes, offline.

Core kinds (StatefulSet, Service, Job, ...) use the Kubernetes JSON schemas that the
``kubernetes-validate`` wheel bundles, strict (an unknown field is an error), for
:data:`KUBERNETES_VERSION`. The custom resources have no bundled schema: the ones below
cover the fields these manifests use, written from the projects' Go API types
(kubeflow/trainer ``trainer.kubeflow.org/v1alpha1``, kubeflow/training-operator
``kubeflow.org/v1`` PyTorchJob, prometheus-operator ``monitoring.coreos.com/v1``
ServiceMonitor). They are strict too, and every embedded Kubernetes type (a Job template
in a runtime, a pod template in a PyTorchJob, a label selector) refers to the core
schema, so a pod template inside a custom resource is checked like one in a Job.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import jsonschema
from referencing import Registry, Resource

__all__ = ["KUBERNETES_VERSION", "SchemaMissingError", "validate"]

KUBERNETES_VERSION = "1.33"
"""The Kubernetes release whose API the manifests are checked against."""

_CORE = "/api/_definitions.json#/$defs/"


class SchemaMissingError(LookupError):
    """Neither the bundled schemas nor ours know this apiVersion and kind."""


def _core(name: str) -> dict[str, Any]:
    return {"$ref": _CORE + name}


def _strict(required: list[str] | None = None, **properties: Any) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": properties,
    }
    if required:
        schema["required"] = required
    return schema


_INT = {"type": "integer"}
_POSITIVE = {"type": "integer", "minimum": 1}
_NON_NEGATIVE = {"type": "integer", "minimum": 0}
_STRING = {"type": "string"}
_STRINGS = {"type": "array", "items": _STRING}
_BOOL = {"type": "boolean"}
_OBJECT = {"type": "object"}
_DNS_LABEL = {"type": "string", "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
# torch's --nproc-per-node values that the Trainer accepts (its XValidation rule).
_NPROC = {"oneOf": [{"enum": ["auto", "cpu", "gpu"]}, _POSITIVE]}


def _resource(api_version: str, kinds: list[str], spec: dict[str, Any]) -> dict[str, Any]:
    return _strict(
        ["apiVersion", "kind", "metadata", "spec"],
        apiVersion={"const": api_version},
        kind={"enum": kinds},
        metadata=_core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        spec=spec,
    )


# sigs.k8s.io/jobset v1alpha2 JobSetSpec, as a runtime's template.
_JOBSET_SPEC = _strict(
    replicatedJobs={
        "type": "array",
        "minItems": 1,
        "items": _strict(
            ["name", "template"],
            name=_DNS_LABEL,
            groupName=_STRING,
            replicas=_POSITIVE,
            template=_core("io.k8s.api.batch.v1.JobTemplateSpec"),
            dependsOn={"type": "array"},
        ),
    },
    network=_strict(enableDNSHostnames=_BOOL, subdomain=_STRING, publishNotReadyAddresses=_BOOL),
    successPolicy=_OBJECT,
    failurePolicy=_OBJECT,
    startupPolicy=_OBJECT,
    suspend=_BOOL,
    coordinator=_OBJECT,
    managedBy=_STRING,
    ttlSecondsAfterFinished=_NON_NEGATIVE,
)

_TORCH_POLICY = _strict(
    numProcPerNode=_NPROC,
    elasticPolicy=_strict(
        maxRestarts=_NON_NEGATIVE, minNodes=_POSITIVE, maxNodes=_POSITIVE, metrics=_OBJECT
    ),
)

_TRAINING_RUNTIME = _resource(
    "trainer.kubeflow.org/v1alpha1",
    ["ClusterTrainingRuntime", "TrainingRuntime"],
    {
        **_strict(
            mlPolicy={
                **_strict(numNodes=_POSITIVE, torch=_TORCH_POLICY, mpi=_OBJECT, flux=_OBJECT),
                # "Only one of the policy can be configured".
                "not": {"required": ["torch", "mpi"]},
            },
            podGroupPolicy=_OBJECT,
            template=_strict(
                metadata=_core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
                spec=_JOBSET_SPEC,
            ),
        ),
        "minProperties": 1,
    },
)

_TRAIN_JOB = _resource(
    "trainer.kubeflow.org/v1alpha1",
    ["TrainJob"],
    _strict(
        ["runtimeRef"],
        runtimeRef=_strict(
            ["name"],
            name={"type": "string", "minLength": 1},
            apiGroup=_STRING,
            kind={"enum": ["ClusterTrainingRuntime", "TrainingRuntime"]},
        ),
        initializer=_OBJECT,
        trainer=_strict(
            image=_STRING,
            command=_STRINGS,
            args=_STRINGS,
            env={"type": "array", "items": _core("io.k8s.api.core.v1.EnvVar")},
            numNodes=_POSITIVE,
            resourcesPerNode=_core("io.k8s.api.core.v1.ResourceRequirements"),
            numProcPerNode=_NPROC,
        ),
        templateOverrides={"type": "array"},
        podTemplateOverrides={"type": "array"},
        suspend=_BOOL,
        managedBy=_STRING,
    ),
)
# The TrainJob's name is its JobSet's and its pods' host names' prefix.
_TRAIN_JOB["properties"]["metadata"] = {
    "allOf": [
        _core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"),
        {"properties": {"name": _DNS_LABEL}, "required": ["name"]},
    ]
}

_REPLICA_SPEC = _strict(
    ["template"],
    replicas=_NON_NEGATIVE,
    template=_core("io.k8s.api.core.v1.PodTemplateSpec"),
    restartPolicy={"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
)

_PYTORCH_JOB = _resource(
    "kubeflow.org/v1",
    ["PyTorchJob"],
    _strict(
        ["pytorchReplicaSpecs"],
        runPolicy=_strict(
            cleanPodPolicy={"enum": ["All", "Running", "None"]},
            ttlSecondsAfterFinished=_INT,
            activeDeadlineSeconds=_INT,
            backoffLimit=_INT,
            schedulingPolicy=_OBJECT,
            suspend=_BOOL,
        ),
        elasticPolicy=_strict(
            minReplicas=_POSITIVE,
            maxReplicas=_POSITIVE,
            rdzvBackend={"enum": ["c10d", "etcd", "etcd-v2"]},
            rdzvPort={"type": "integer", "minimum": 1, "maximum": 65535},
            rdzvHost=_STRING,
            rdzvId=_STRING,
            rdzvConf={"type": "array", "items": _strict(key=_STRING, value=_STRING)},
            standalone=_BOOL,
            nProcPerNode=_POSITIVE,
            maxRestarts=_NON_NEGATIVE,
            metrics={"type": "array"},
        ),
        nprocPerNode=_STRING,
        pytorchReplicaSpecs={
            "type": "object",
            "minProperties": 1,
            "propertyNames": {"enum": ["Master", "Worker"]},
            "additionalProperties": _REPLICA_SPEC,
        },
    ),
)

# prometheus-operator's monitoringv1.Duration.
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
    r"(([0-9]+)s)?(([0-9]+)ms)?)$",
}

_SCRAPE_ENDPOINT = _strict(
    port=_STRING,
    targetPort=_core("io.k8s.apimachinery.pkg.util.intstr.IntOrString"),
    path=_STRING,
    scheme={"enum": ["http", "https", "HTTP", "HTTPS"]},
    params=_OBJECT,
    interval=_DURATION,
    scrapeTimeout=_DURATION,
    honorLabels=_BOOL,
    honorTimestamps=_BOOL,
    tlsConfig=_OBJECT,
    authorization=_OBJECT,
    relabelings={"type": "array"},
    metricRelabelings={"type": "array"},
    followRedirects=_BOOL,
    enableHttp2=_BOOL,
    filterRunning=_BOOL,
)

_SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    ["ServiceMonitor"],
    _strict(
        ["selector", "endpoints"],
        jobLabel=_STRING,
        targetLabels=_STRINGS,
        podTargetLabels=_STRINGS,
        endpoints={"type": "array", "minItems": 1, "items": _SCRAPE_ENDPOINT},
        selector=_core("io.k8s.apimachinery.pkg.apis.meta.v1.LabelSelector"),
        namespaceSelector=_strict(any=_BOOL, matchNames=_STRINGS),
        sampleLimit=_NON_NEGATIVE,
        targetLimit=_NON_NEGATIVE,
        labelLimit=_NON_NEGATIVE,
        attachMetadata=_OBJECT,
        scrapeClass=_STRING,
    ),
)

CUSTOM_RESOURCES: dict[tuple[str, str], dict[str, Any]] = {
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): _TRAINING_RUNTIME,
    ("trainer.kubeflow.org/v1alpha1", "TrainingRuntime"): _TRAINING_RUNTIME,
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): _TRAIN_JOB,
    ("kubeflow.org/v1", "PyTorchJob"): _PYTORCH_JOB,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _SERVICE_MONITOR,
}


def _schema_folder() -> Any:
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    return folder / f"v{KUBERNETES_VERSION}.0-local-strict"


@functools.cache
def _registry() -> Registry:
    definitions = json.loads((_schema_folder() / "_definitions.json").read_text())
    registry: Registry = Resource.from_contents(definitions) @ Registry()
    return registry


def _core_schema(api_version: str, kind: str) -> dict[str, Any] | None:
    # kubernetes-validate's file names: "<kind>-<group without domain>-<version>.json".
    group, _, version = api_version.rpartition("/")
    stem = f"{group.split('.')[0]}-{version}" if group else version
    path = _schema_folder() / f"{kind.lower()}-{stem}.json"
    if not path.is_file():
        return None
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def validate(document: dict[str, Any]) -> None:
    """Check one manifest document against its schema.

    Raises:
        jsonschema.ValidationError: the document breaks the schema (the first error).
        SchemaMissingError: no schema for its apiVersion and kind.
    """
    key = (str(document.get("apiVersion")), str(document.get("kind")))
    schema = CUSTOM_RESOURCES.get(key) or _core_schema(*key)
    if schema is None:
        raise SchemaMissingError(f"no schema for apiVersion {key[0]!r} kind {key[1]!r}")
    # Our schemas refer to the core definitions the way the bundled ones do.
    schema = {"$id": "https://kubernetes.io/api/etcd-elastic", **schema}
    validator = jsonschema.Draft202012Validator(schema, registry=_registry())
    error = jsonschema.exceptions.best_match(validator.iter_errors(document))
    if error is not None:
        raise error

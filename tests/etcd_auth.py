"""etcd with auth enabled, set up as an operator does it with etcdctl: a root user, and
users whose one role may use only the key ranges a test grants (docs/security.md)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Grant", "enable_auth", "etcdctl", "run_grants_without_store_writes"]


@dataclass(frozen=True)
class Grant:
    """``permission`` (read, write, readwrite) on the keys in [``key``, ``range_end``)."""

    permission: str
    key: str
    range_end: str


def etcdctl(endpoint: str, *args: str) -> None:
    """Run etcdctl (the one beside this interpreter) against ``endpoint``; fail the test
    with its output if it fails."""
    binary = Path(sys.executable).parent / "etcdctl"
    command = [str(binary), f"--endpoints={endpoint}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def enable_auth(
    endpoint: str, root_password: str, users: dict[str, tuple[str, Sequence[Grant]]]
) -> None:
    """Add root and each ``users[name] = (password, grants)`` (one role per user, named
    after it), then enable auth."""
    etcdctl(endpoint, "user", "add", f"root:{root_password}")
    etcdctl(endpoint, "role", "add", "root")
    etcdctl(endpoint, "user", "grant-role", "root", "root")
    for name, (password, grants) in users.items():
        etcdctl(endpoint, "role", "add", name)
        for grant in grants:
            etcdctl(
                endpoint, "role", "grant-permission", name, grant.permission, grant.key,
                grant.range_end,
            )  # fmt: skip
        etcdctl(endpoint, "user", "add", f"{name}:{password}")
        etcdctl(endpoint, "user", "grant-role", name, name)
    etcdctl(endpoint, "auth", "enable")


def run_grants_without_store_writes(run_prefix: str) -> list[Grant]:
    """Everything under ``run_prefix`` (``<key_prefix>/<run_id>/``) read-write, except the
    Store's keys (``store/``), which may only be read: the rendezvous works (a coordinator
    reads the store's rounds), the first Store write is refused."""
    if not run_prefix.endswith("/"):
        raise ValueError(f"run prefix {run_prefix!r} must end with '/'")
    store = run_prefix + "store/"
    after_store = run_prefix + "store0"  # "0" is the byte after "/"
    end_of_run = run_prefix[:-1] + "0"
    return [
        Grant("readwrite", run_prefix, store),
        Grant("read", store, after_store),
        Grant("readwrite", after_store, end_of_run),
    ]

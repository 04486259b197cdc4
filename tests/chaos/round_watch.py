"""The moment etcd commits a newer round: ``etcdctl watch`` on the run's state key.

``rank_exchange_fault`` must kill an agent after a round completed and before its
workers start, while the agents exchange ranks through the round's store. Agents report
``round`` in the history only once that exchange is over, so the harness watches etcd
itself: the coordinator's commit of the state key with a newer ``round`` (docs/keys.md:
protobuf JSON, int64 as a string, absent while zero) starts the exchange.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RoundWatch", "state_round"]


def state_round(value: bytes) -> int:
    """The ``round`` of a stored ``RendezvousState`` value (0 when absent; -1 unreadable)."""
    try:
        state = json.loads(value)
        return int(state.get("round", 0)) if isinstance(state, dict) else -1
    except (ValueError, TypeError):
        return -1


def _rounds(response: dict[str, Any], key: str) -> list[int]:
    """Rounds in one ``etcdctl -w json`` answer (a watch response or a get)."""
    kvs = [e.get("kv", {}) for e in response.get("Events") or []] + list(response.get("kvs") or [])
    found = []
    for kv in kvs:
        if base64.b64decode(kv.get("key", "")).decode(errors="replace") == key:
            found.append(state_round(base64.b64decode(kv.get("value", ""))))
    return found


class RoundWatch:
    """A running ``etcdctl watch`` of one state key; use as a context manager.

    Entering reads the key (:attr:`current`) and watches from the next revision, so no
    commit between the read and the watch is missed. ``user`` (``root:PASSWORD``) when
    etcd has auth.
    """

    def __init__(self, etcdctl: Path, endpoints: str, key: str, *, user: str = "") -> None:
        self._argv = [str(etcdctl), f"--endpoints={endpoints}", "-w", "json"]
        self._argv += [f"--user={user}"] if user else []
        self._key = key
        self._env = {**os.environ, "ETCDCTL_API": "3"}
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self.current = -1
        """The round stored when the watch began (-1: etcd did not answer)."""

    def __enter__(self) -> RoundWatch:
        self.current, revision = self._read()
        since = [f"--rev={revision + 1}"] if revision > 0 else []
        self._proc = subprocess.Popen(
            [*self._argv, "watch", *since, self._key],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=self._env,
            start_new_session=True,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

    def _read(self) -> tuple[int, int]:
        """(round, revision) now, by one ``etcdctl get``; (-1, 0) if etcd did not answer."""
        done = subprocess.run(
            [*self._argv, "--command-timeout=5s", "get", self._key],
            capture_output=True,
            env=self._env,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            return -1, 0
        with contextlib.suppress(ValueError, KeyError, TypeError):
            answer = json.loads(done.stdout)
            revision = int(answer["header"]["revision"])
            return max(_rounds(answer, self._key), default=0), revision
        return -1, 0

    def wait_newer(
        self,
        before: int,
        timeout: float,
        tick: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> int | None:
        """The first round above ``before`` that the watch reports within ``timeout``
        seconds, else None; ``tick`` runs between reads (at least every 10 ms)."""
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise RuntimeError("RoundWatch.wait_newer outside its with-block")
        fd = proc.stdout.fileno()
        deadline = clock() + timeout
        while clock() < deadline:
            tick()
            ready, _, _ = select.select([fd], [], [], 0.01)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # etcdctl ended
            self._buffer += chunk
            *lines, self._buffer = self._buffer.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    newer = [r for r in _rounds(json.loads(line), self._key) if r > before]
                    if newer:
                        return newer[0]
        return None

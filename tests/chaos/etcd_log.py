"""What etcd itself saw of a run: every write under the run's prefix, and the check of
fenced commits against it (in the spirit of etcd's robustness tests: the server's own
history, not the clients' word).

:class:`EtcdLog` runs ``etcdctl watch --prefix`` on the run's keys for the whole run and
appends etcd's answers to a file. Each (re)start first writes a snapshot (``get
--prefix``) and watches from the snapshot's revision + 1, so a watch ended by a cluster
restart or a compaction leaves a gap whose end is known exactly: a write inside a gap is
not seen, and the node keys are known again from the snapshot on.

:func:`fenced_commits` then checks that every state write that commits a newer round was
made while its writer's node key existed (DESIGN: a coordinator's commit is guarded by its
own key's create revision in the same transaction). Without that fence a coordinator
frozen past its TTL and resumed can commit a round decided from a stale node table, with
itself as a member whose key is gone.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tests.chaos.verdict import Violation

__all__ = ["EtcdLog", "KvEvent", "fenced_commits", "read_etcd_log"]


@dataclass(frozen=True)
class KvEvent:
    """One write etcd applied, or one key of a snapshot (``kind == "snapshot"``)."""

    kind: str  # "put", "delete", "snapshot", or "gap" (key empty: a new snapshot follows)
    key: str
    revision: int  # the write's mod revision; a snapshot's header revision
    create_revision: int = 0
    value: bytes = b""


def _kv(kind: str, kv: dict[str, Any], revision: int = 0) -> KvEvent:
    return KvEvent(
        kind=kind,
        key=base64.b64decode(kv.get("key", "")).decode(errors="replace"),
        revision=revision or int(kv.get("mod_revision", 0)),
        create_revision=int(kv.get("create_revision", 0)),
        value=base64.b64decode(kv.get("value", "")),
    )


def parse_line(line: str) -> list[KvEvent]:
    """The events of one line of the log: a snapshot or a watch answer (else none)."""
    try:
        record = json.loads(line)
    except ValueError:
        return []
    if not isinstance(record, dict):
        return []
    if record.get("snapshot") is not None:
        answer = record["snapshot"]
        revision = int(answer.get("header", {}).get("revision", 0))
        return [KvEvent("gap", "", revision)] + [
            _kv("snapshot", kv, revision) for kv in answer.get("kvs") or []
        ]
    return [
        _kv("delete" if event.get("type") == 1 else "put", event.get("kv", {}))
        for event in record.get("Events") or []
    ]


def read_etcd_log(path: Path) -> list[KvEvent]:
    """Every event of the log at ``path``, in the order etcd applied them."""
    if not path.exists():
        return []
    return [e for line in path.read_text(errors="replace").splitlines() for e in parse_line(line)]


def _round_and_writer(value: bytes) -> tuple[int, str] | None:
    try:
        state = json.loads(value)
        return int(state.get("round", 0)), str(state.get("written_by", ""))
    except (ValueError, TypeError, AttributeError):
        return None


def fenced_commits(events: Sequence[KvEvent], run_prefix: str) -> Iterator[Violation]:
    """Every state write that commits a newer round was written while its writer's node
    key existed (pure)."""
    name = "fenced_commits"
    state_key, nodes = f"{run_prefix}/state", f"{run_prefix}/nodes/"
    live: set[str] = set()
    last_round = -1
    for index, event in enumerate(events):
        if event.kind == "gap":
            # What came before is replaced by the snapshot that follows (a write inside
            # the gap is not seen); an absent state key is round 0.
            live.clear()
            last_round = 0
        elif event.key.startswith(nodes):
            node = event.key[len(nodes) :]
            if event.kind == "delete":
                live.discard(node)
            else:
                live.add(node)
        elif event.key == state_key and event.kind == "delete":
            last_round = 0
        elif event.key == state_key:
            decoded = _round_and_writer(event.value)
            if decoded is None:
                continue
            round_, writer = decoded
            newer = event.kind == "put" and 0 <= last_round < round_
            if newer and writer not in live:
                yield Violation(
                    name,
                    f"round {round_} was committed at revision {event.revision} by "
                    f"{writer or '(nobody)'}, whose node key was gone: an unfenced commit "
                    "from a stale node table",
                    index,
                    {"revision": event.revision, "round": round_, "written_by": writer},
                )
            last_round = round_


class EtcdLog:
    """``etcdctl watch --prefix`` of a run's keys into a file, restarted whenever it ends
    (a cluster restart, a compaction), each start preceded by a snapshot. A context
    manager; a thread of its own restarts it. ``user`` (``root:PASSWORD``) when etcd has
    auth."""

    def __init__(
        self, etcdctl: Path, endpoints: str, prefix: str, out: Path, *, user: str = ""
    ) -> None:
        self._argv = [str(etcdctl), f"--endpoints={endpoints}", "-w", "json"]
        self._argv += [f"--user={user}"] if user else []
        self._prefix = prefix
        self._out = out
        self._env = {**os.environ, "ETCDCTL_API": "3"}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-etcd-log", daemon=True)

    def __enter__(self) -> EtcdLog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        self._thread.join(15)

    def _snapshot(self, sink: BinaryIO) -> int:
        """Write a snapshot line; its revision (0: etcd did not answer)."""
        done = subprocess.run(
            [*self._argv, "--command-timeout=5s", "get", "--prefix", self._prefix],
            capture_output=True,
            env=self._env,
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            return 0
        try:
            answer = json.loads(done.stdout)
            revision = int(answer["header"]["revision"])
        except (ValueError, KeyError, TypeError):
            return 0
        sink.write(json.dumps({"snapshot": answer}, separators=(",", ":")).encode() + b"\n")
        sink.flush()
        return revision

    def _run(self) -> None:
        with self._out.open("ab") as sink:
            while not self._stop.is_set():
                revision = self._snapshot(sink)
                if not revision:
                    self._stop.wait(0.5)
                    continue
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._proc = subprocess.Popen(
                        [*self._argv, "watch", "--prefix", f"--rev={revision + 1}", self._prefix],
                        stdin=subprocess.DEVNULL,
                        stdout=sink,
                        stderr=subprocess.DEVNULL,
                        env=self._env,
                        start_new_session=True,
                    )
                    proc = self._proc
                proc.wait()
                sink.flush()
                if not self._stop.is_set():
                    self._stop.wait(0.2)

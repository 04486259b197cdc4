"""Child processes of the harness: node processes and the c10d store host.

Each child runs in its own session (so a SIGKILL of its group takes its helpers too),
talks JSON lines over stdin/stdout, and is always reaped, even when a run fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["REPO_ROOT", "Child", "NodeGroup", "RunError", "cpu_seconds", "split_nodes"]

REPO_ROOT = Path(__file__).resolve().parent.parent
# A profiled node process (BENCH_PROFILE_DIR) needs time to write its profile at exit.
_GRACE_S = 60.0 if os.environ.get("BENCH_PROFILE_DIR") else 3.0


class RunError(RuntimeError):
    """A measured run failed or ran out of time; the message says which and why."""


def split_nodes(nodes: int, processes: int) -> list[list[int]]:
    """Deal node indexes ``0..nodes-1`` round-robin over at most ``processes`` lists."""
    count = max(1, min(nodes, processes))
    return [list(range(i, nodes, count)) for i in range(count)]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds used so far by process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    # After the command name: state is field 3, utime 14 and stime 15 (1-based).
    return (int(fields[11]) + int(fields[12])) / ticks


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    return env


class Child:
    """One child Python process speaking JSON lines; its replies land in a shared queue."""

    def __init__(self, index: int, argv: Sequence[str], replies: queue.Queue[Any]) -> None:
        self.index = index
        self.killed = False
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix="bench-child-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=REPO_ROOT,
            env=_child_env(),
            start_new_session=True,
            text=True,
        )
        self._reader = threading.Thread(
            target=self._read, args=(self.proc.stdout, replies), daemon=True
        )
        self._reader.start()

    def _read(self, stream: IO[str] | None, replies: queue.Queue[Any]) -> None:
        if stream is None:
            return
        for line in stream:
            with contextlib.suppress(ValueError):
                replies.put((self.index, json.loads(line)))
        replies.put((self.index, {"event": "eof"}))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: dict[str, Any]) -> None:
        if self.proc.stdin is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def kill(self) -> None:
        """SIGKILL the child's whole session at once (a crashed machine)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        """Close stdin (the child exits), wait a grace period, kill its group, reap it."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=_GRACE_S)
        self.kill()
        self.proc.wait()
        self._reader.join(timeout=_GRACE_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        with contextlib.suppress(OSError):
            os.unlink(self._log.name)


class NodeGroup:
    """Simulated nodes as threads in a few node processes (see ``benchmarks.node``)."""

    def __init__(self, spec: dict[str, Any], layout: list[list[int]]) -> None:
        self.replies: queue.Queue[Any] = queue.Queue()
        self.layout = layout
        self.children: list[Child] = []
        self._next_id = 0
        # Every child ever started, by the tag its replies carry: a replaced child's late
        # end-of-file must not be taken for its successor's.
        self._by_tag: dict[int, Child] = {}
        self._spec = spec
        self._backlog: list[tuple[int, dict[str, Any]]] = []

    def __enter__(self) -> NodeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, nodes: list[int], spec: dict[str, Any]) -> Child:
        tag = len(self._by_tag)
        child = Child(tag, ["-m", "benchmarks.node"], self.replies)
        self._by_tag[tag] = child
        child.send({**spec, "nodes": nodes})
        return child

    def start(self, timeout: float) -> None:
        """Start every node process and wait until all its handlers are built."""
        self._next_id += 1
        spec = {**self._spec, "id": self._next_id}
        self.children = [self._spawn(nodes, spec) for nodes in self.layout]
        self._collect({"ready"}, len(self.layout), self._next_id, timeout, "start")

    def rebuild(self, spec: dict[str, Any], timeout: float) -> None:
        """Give every node fresh handlers for ``spec`` (a new run), keeping the processes.

        A live process drops its old handlers and builds new ones (no torch import again);
        a process that was killed (node-loss) is started afresh.
        """
        self._next_id += 1
        self._spec = spec
        for position, (child, nodes) in enumerate(zip(self.children, self.layout, strict=True)):
            if child.killed or child.proc.poll() is not None:
                child.stop()
                self.children[position] = self._spawn(nodes, {**spec, "id": self._next_id})
            else:
                child.send({"cmd": "build", "id": self._next_id, "spec": {**spec, "nodes": nodes}})
        self._collect({"ready"}, len(self.layout), self._next_id, timeout, "rebuild")

    def process_of(self, node: int) -> Child:
        for child, nodes in zip(self.children, self.layout, strict=True):
            if node in nodes:
                return child
        raise KeyError(f"node {node} is in no process")

    def command(self, cmd: dict[str, Any], children: Sequence[Child] | None = None) -> int:
        """Send ``cmd`` (with a fresh ``id``) to ``children`` (all by default); return the id."""
        self._next_id += 1
        message = {**cmd, "id": self._next_id}
        for child in self.children if children is None else children:
            child.send(message)
        return self._next_id

    def results(self, cmd_id: int, count: int, timeout: float) -> list[dict[str, Any]]:
        """Wait for ``count`` per-node answers (``done`` or ``error``) to command ``cmd_id``.

        Raises:
            RunError: a node process died, or fewer answers came within ``timeout``.
        """
        return self._collect({"done", "error"}, count, cmd_id, timeout, f"command {cmd_id}")

    def counters(self, timeout: float = 30.0) -> dict[str, int]:
        """The per-process counters (torch backend calls, failed CAS, ours), summed."""
        cmd_id = self.command({"cmd": "counters"})
        live = sum(1 for c in self.children if c.proc.poll() is None)
        total: dict[str, int] = {}
        for reply in self._collect({"counters"}, live, cmd_id, timeout, "counters"):
            for key, value in reply["values"].items():
                total[key] = total.get(key, 0) + int(value)
        return total

    def stamps(self, since: float, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Every live process's critical-path stamps at or after ``since`` (see
        ``benchmarks.critical_path.process_report``)."""
        cmd_id = self.command({"cmd": "stamps", "since": since})
        live = sum(1 for c in self.children if c.proc.poll() is None)
        return [r["values"] for r in self._collect({"stamps"}, live, cmd_id, timeout, "stamps")]

    def _collect(
        self, kinds: set[str], count: int, cmd_id: int | None, timeout: float, what: str
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        got: list[dict[str, Any]] = []

        def wanted(reply: dict[str, Any]) -> bool:
            return reply.get("event") in kinds and (cmd_id is None or reply.get("id") == cmd_id)

        # Answers to other commands that arrived while we waited stay for their turn.
        for item in list(self._backlog):
            if len(got) < count and wanted(item[1]):
                self._backlog.remove(item)
                got.append(item[1])
        while len(got) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                failed = [r for r in got if r.get("event") == "error"]
                sample = f" ({len(failed)} errors, e.g. {failed[0].get('error')})" if failed else ""
                raise RunError(
                    f"{what}: {len(got)} of {count} answers after {timeout:.0f} s{sample}"
                )
            try:
                index, reply = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            event = reply.get("event")
            child = self._by_tag[index]
            if event in ("fatal", "eof") and not child.killed:
                raise RunError(
                    f"node process {index} (pid {child.pid}) failed during {what}: "
                    f"{reply.get('error', 'exited')}\n{child.log_tail()}"
                )
            if wanted(reply):
                got.append(reply)
            elif event not in ("fatal", "eof"):
                self._backlog.append((index, reply))
        return got

    def kill(self, child: Child) -> float:
        """SIGKILL one node process; return the ``time.monotonic()`` just before the kill."""
        child.killed = True
        t_kill = time.monotonic()
        child.kill()
        return t_kill

    def close(self) -> None:
        for child in self.children:
            child.send({"cmd": "exit"})
        for child in self._by_tag.values():
            child.stop()

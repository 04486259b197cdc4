"""Where each worker's stdout/stderr go: console, files, or both; one folder per attempt.

Layout (as torch's ``DefaultLogsSpecs``)::

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stdout.log
                                                        /stderr.log
                                                        /error.json

One difference from torch, on purpose: ``n`` counts every start of the worker group by
this agent (restarts for membership changes included), so no attempt's logs overwrite
another's; torch numbers by the failure restart count and wipes the folder when a
membership change restarts with the same count.

Stream choices per local rank: ``--redirects`` sends a stream to its file only,
``--tee`` to the file and the console (each console line prefixed like torch's
``[default0]:`` or by ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), neither leaves it on
the console unprefixed. ``--local-ranks-filter`` hides the other ranks from the console
(their files are still written).
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import IO, TextIO

__all__ = [
    "STD_ERR",
    "STD_OUT",
    "LinePump",
    "LogSpec",
    "RunLogDir",
    "StreamPlan",
    "WorkerLogs",
    "console_prefix",
    "plan_attempt",
]

STD_OUT = 1
STD_ERR = 2


@dataclass(frozen=True)
class StreamPlan:
    """Where one stream goes: a file (or not) and the console (or not).

    Neither: discarded. Console only: the worker writes to the agent's own stream.
    File only: the worker writes to the file. Both: a :class:`LinePump` copies each line
    to the file and, prefixed, to the console.
    """

    file: str | None
    console: bool

    @property
    def piped(self) -> bool:
        """True when the stream needs a pump (tee)."""
        return self.file is not None and self.console


@dataclass(frozen=True)
class WorkerLogs:
    """The streams and the error file of one worker."""

    stdout: StreamPlan
    stderr: StreamPlan
    error_file: str
    prefix: str


@dataclass(frozen=True)
class LogSpec:
    """The ``--log-dir``, ``--redirects``, ``--tee`` and ``--local-ranks-filter`` choices.

    ``redirects`` and ``tee`` map a local rank to torch's Std bits (1 stdout, 2 stderr,
    3 both); a rank not in the map gets 0.
    """

    log_dir: str | None = None
    redirects: Mapping[int, int] | None = None
    tee: Mapping[int, int] | None = None
    local_ranks_filter: frozenset[int] | None = None
    prefix_template: str | None = None


def console_prefix(template: str | None, role: str, global_rank: int, local_rank: int) -> str:
    """The console prefix of a tee'd worker line: ``[<role><local_rank>]:`` like torch,
    or ``template`` with ``${role_name}``, ``${rank}``, ``${local_rank}`` substituted."""
    if template:
        return Template(template).safe_substitute(
            role_name=role, rank=global_rank, local_rank=local_rank
        )
    return f"[{role}{local_rank}]:"


def _stream(path: Path, bit: int, to_file: int, tee_bits: int, shown: bool) -> StreamPlan:
    file = str(path) if to_file & bit else None
    # Without a file a stream stays on the console unless filtered out; with one it
    # reaches the console only when tee'd and not filtered out.
    return StreamPlan(file, shown and (file is None or bool(tee_bits & bit)))


def plan_attempt(
    spec: LogSpec, attempt_dir: Path, prefixes: Mapping[int, str]
) -> dict[int, WorkerLogs]:
    """Decide every worker's streams for one attempt (pure: creates nothing).

    Args:
        spec: the user's choices.
        attempt_dir: ``.../attempt_<n>``; each rank's files go in ``<attempt_dir>/<rank>/``.
        prefixes: local rank -> console prefix; its keys are the local ranks to plan.
    """
    redirects = spec.redirects or {}
    tee = spec.tee or {}
    plans: dict[int, WorkerLogs] = {}
    for local_rank, prefix in prefixes.items():
        folder = attempt_dir / str(local_rank)
        to_file = redirects.get(local_rank, 0) | tee.get(local_rank, 0)
        tee_bits = tee.get(local_rank, 0)
        shown = spec.local_ranks_filter is None or local_rank in spec.local_ranks_filter

        plans[local_rank] = WorkerLogs(
            stdout=_stream(folder / "stdout.log", STD_OUT, to_file, tee_bits, shown),
            stderr=_stream(folder / "stderr.log", STD_ERR, to_file, tee_bits, shown),
            error_file=str(folder / "error.json"),
            prefix=prefix,
        )
    return plans


class RunLogDir:
    """This agent's log folder for the run, made on first use, one subfolder per attempt.

    Without ``--log-dir`` a temporary folder is used (as torch does), so every worker
    still gets an error file for the root-cause report.
    """

    def __init__(self, base: str | None, run_id: str) -> None:
        self._base = base
        self._run_id = run_id
        self._root: Path | None = None

    @property
    def root(self) -> Path:
        """``<log_dir>/<run_id>_<random>``, created when first asked for."""
        if self._root is None:
            if self._base is not None:
                Path(self._base).mkdir(parents=True, exist_ok=True)
            base = self._base or tempfile.mkdtemp(prefix="etcd_elastic_")
            self._root = Path(tempfile.mkdtemp(prefix=f"{self._run_id}_", dir=base))
        return self._root

    def attempt(self, number: int, local_ranks: range) -> Path:
        """Create ``attempt_<number>/<local_rank>/`` for every rank; returns the attempt."""
        path = self.root / f"attempt_{number}"
        for local_rank in local_ranks:
            (path / str(local_rank)).mkdir(parents=True, exist_ok=True)
        return path


class LinePump:
    """Copies a worker's piped stream, line by line, to its file and to the console.

    Runs in a daemon thread that ends when the pipe closes (every process holding its
    write end exited), so it never delays the agent's exit.
    """

    def __init__(self, source: IO[bytes], file: str, console: TextIO, prefix: str) -> None:
        self._source = source
        self._file = file
        self._console = console
        self._prefix = prefix
        self._thread = threading.Thread(target=self._run, name=f"pump {file}", daemon=True)

    def start(self) -> None:
        """Start copying."""
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the pipe to close; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        with self._source, open(self._file, "ab") as out:
            for line in iter(self._source.readline, b""):
                out.write(line)
                out.flush()
                text = line.decode("utf-8", errors="replace")
                if not text.endswith("\n"):
                    text += "\n"
                self._console.write(f"{self._prefix}{text}")
                self._console.flush()

"""Report training progress to the agent: one line in the training loop.

    from agent.progress import report_progress

    for step in range(start, steps):
        train_one_step()
        report_progress(step)

With ``etcdrun --hang-timeout S``, a node whose workers report no progress for ``S``
seconds is declared hung and the whole run re-forms (a counted restart on every node),
naming the node(s) that stopped first (``docs/hang-detection.md``). Without the agent
(``python train.py``, stock ``torchrun``) the call does nothing.

Cost: under a microsecond, and no system call. The agent creates a small file and passes
its path in ``ETCD_ELASTIC_PROGRESS_FILE``; the first call maps it into memory (slot
``LOCAL_RANK``), every call then stores ``(step, time.monotonic_ns(), step)`` into the
mapping. The agent reads the slots every fraction of a second and publishes the node's
progress to etcd at most about once a second, so training steps never cause etcd writes.

This module imports only the standard library (``mmap``, ``os``, ``struct``, ``time``),
so a worker pays nothing for it; the agent's reading side lives here too because both
sides must agree on the layout:

    bytes 0-63                header: b"EEPROG1\\0", then the slot count (uint32, little endian)
    bytes 64 + 64*i ... +24   slot of local rank i: step, monotonic ns, step again (int64 LE)

A slot whose time is 0 was never written. The step is stored twice so that the reader can
tell a value it read while the worker was writing it (the copies differ) and read again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import tempfile
import time

__all__ = ["PROGRESS_FILE_ENV", "ProgressFile", "report_progress"]

PROGRESS_FILE_ENV = "ETCD_ELASTIC_PROGRESS_FILE"
"""Set by the agent for every worker: the progress file of its node."""

_MAGIC = b"EEPROG1\0"
_HEADER = struct.Struct("<8sI")
_HEADER_SIZE = 64
_SLOT_SIZE = 64  # one cache line per worker: workers never share one
_SLOT = struct.Struct("<qqq")

# The worker side: resolved on the first call, then one pack_into per call.
_pack = _SLOT.pack_into
_now = time.monotonic_ns
_map: mmap.mmap | None = None
_offset = 0
_resolved = False


def report_progress(step: int) -> None:
    """Tell the agent this worker finished ``step`` (any int64; the global step is best).

    Call it once per training step, after the step's work (its last collective
    included): a worker that stops calling it for ``--hang-timeout`` seconds is hung.
    Without ``etcdrun`` (no ``ETCD_ELASTIC_PROGRESS_FILE``) it returns at once.
    """
    if _map is None and (_resolved or not _open()):
        return
    _pack(_map, _offset, step, _now(), step)  # type: ignore[arg-type]


def _open() -> bool:
    """Map this worker's slot; False (and report_progress stays a no-op) without one."""
    global _map, _offset, _resolved
    _resolved = True
    path = os.environ.get(PROGRESS_FILE_ENV)
    if not path:
        return False
    try:
        slot = int(os.environ.get("LOCAL_RANK", "0"))
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)
        magic, slots = _HEADER.unpack_from(mapped, 0)
        if magic != _MAGIC or not 0 <= slot < slots:
            mapped.close()
            raise ValueError(f"not a progress file with a slot for LOCAL_RANK {slot}")
    except (OSError, ValueError) as exc:
        # Progress is advisory: training goes on, the agent just sees no progress.
        print(f"agent.progress: not reporting progress ({path}: {exc})", file=sys.stderr)
        return False
    _map, _offset = mapped, _HEADER_SIZE + slot * _SLOT_SIZE
    return True


class ProgressFile:
    """The agent's side: the file of one node's workers, one slot per local rank.

    Args:
        slots: local workers (``--nproc-per-node``).
        directory: where to create it (default: the temporary directory).
    """

    def __init__(self, slots: int, directory: str | None = None) -> None:
        if slots < 1:
            raise ValueError(f"a progress file needs at least one slot, got {slots}")
        self.slots = slots
        fd, self.path = tempfile.mkstemp(prefix="etcd-elastic-progress-", dir=directory)
        try:
            os.ftruncate(fd, _HEADER_SIZE + slots * _SLOT_SIZE)
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, _MAGIC, slots)

    def reset(self) -> None:
        """Forget every report (call it while no worker runs: a new attempt starts)."""
        self._map[_HEADER_SIZE:] = bytes(self.slots * _SLOT_SIZE)

    def read(self) -> list[tuple[int, int] | None]:
        """(step, monotonic ns of the report) per local rank; None: no report yet."""
        out: list[tuple[int, int] | None] = []
        for slot in range(self.slots):
            offset = _HEADER_SIZE + slot * _SLOT_SIZE
            for _ in range(3):
                step, ns, check = _SLOT.unpack_from(self._map, offset)
                if step == check:
                    break
            out.append((step, ns) if ns else None)
        return out

    def close(self) -> None:
        """Unmap and remove the file. Idempotent."""
        if not self._map.closed:
            self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

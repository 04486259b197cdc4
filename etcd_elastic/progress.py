"""Report training progress to the agent: one line in the training loop.

    from etcd_elastic.progress import report_progress

    for step in range(start, steps):
        train_one_step()
        report_progress(step)

With ``etcdrun --hang-timeout S``, a node whose workers report no progress for ``S``
seconds is declared hung and the whole run re-forms (a counted restart on every node),
naming the node(s) that stopped first (``docs/hang-detection.md``). Without the agent
(``python train.py``, stock ``torchrun``) the call does nothing.

Cost: a function call and two 8-byte stores, no system call and no clock read (measured
by ``python -m benchmarks.progress_call``). The agent creates a small file and passes its
path in ``ETCD_ELASTIC_PROGRESS_FILE``; the first call maps it into memory (slot
``LOCAL_RANK``), every call then stores the step and the number of calls so far into the
mapping. The agent reads the slots every fraction of a second and notes on its own
monotonic clock when the count changed; it writes to etcd only when the node's workers
made no progress for most of ``--hang-timeout``, so training steps never cause etcd
writes. Every call is progress, even with the same step (an evaluation loop, a
checkpoint may report the last step again).

This module imports only the standard library (``mmap``, ``os``, ``struct``, ``tempfile``),
so a worker pays nothing for it; the agent's reading side lives here too because both
sides must agree on the layout:

    bytes 0-63               header: b"EEPROG2\\0", then the slot count (uint32, little endian)
    bytes 64 + 64*i ... +16  slot of local rank i: the last step, then the number of calls
                             (two int64, native order)

A slot whose count is 0 has not been written since the agent reset it for the attempt.
Each 8-byte store is aligned, so the agent never reads half of one; it may read a new
step with the old count, and then sees the count one tick later.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import struct
import sys
import tempfile

__all__ = ["PROGRESS_FILE_ENV", "ProgressFile", "pause_progress", "report_progress"]

PROGRESS_FILE_ENV = "ETCD_ELASTIC_PROGRESS_FILE"
"""Set by the agent for every worker: the progress file of its node."""

_MAGIC = b"EEPROG2\0"
_HEADER = struct.Struct("<8sI")
_HEADER_SIZE = 64
_SLOT_SIZE = 64  # one cache line per worker: workers never share one
# The worker side: resolved on the first call, then one store per call.
_slots: memoryview | None = None
_index = 0
_calls = 0
_resolved = False


def report_progress(step: int) -> None:
    """Tell the agent this worker finished ``step`` (any int64; the global step is best).

    Call it once per training step, after the step's work (its last collective
    included): a worker that stops calling it for ``--hang-timeout`` seconds is hung.
    Without ``etcdrun`` (no ``ETCD_ELASTIC_PROGRESS_FILE``) it returns at once.
    """
    global _calls
    if _slots is None and (_resolved or not _open()):
        return
    _calls += 1
    _slots[_index] = step  # type: ignore[index]
    _slots[_index + 1] = _calls  # type: ignore[index]


def pause_progress() -> None:
    """Stop being watched until the next :func:`report_progress`.

    For work after the training loop that reports nothing and may outlast
    ``--hang-timeout`` (a final checkpoint or evaluation, tearing down the process
    group). Called by itself when the interpreter exits. Does nothing without etcdrun.
    """
    if _slots is not None:
        _slots[_index + 1] = 0  # a count of 0: "no report" for the agent


def _open() -> bool:
    """Map this worker's slot; False (and report_progress stays a no-op) without one."""
    global _slots, _index, _resolved
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
        print(f"etcd_elastic.progress: not reporting progress ({path}: {exc})", file=sys.stderr)
        return False
    _slots, _index = memoryview(mapped).cast("q"), (_HEADER_SIZE + slot * _SLOT_SIZE) // 8
    # The interpreter's own shutdown (torch's exit handlers, joining threads) is no step.
    atexit.register(pause_progress)
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
        self._words = memoryview(self._map).cast("q")
        self.reset()

    def reset(self) -> None:
        """Forget every report (call it while no worker runs: a new attempt starts)."""
        for slot in range(self.slots):
            word = (_HEADER_SIZE + slot * _SLOT_SIZE) // 8
            self._words[word] = self._words[word + 1] = 0

    def read(self) -> list[tuple[int, int] | None]:
        """(last step, calls so far) of each local rank; None: no call since the reset."""
        out: list[tuple[int, int] | None] = []
        for slot in range(self.slots):
            word = (_HEADER_SIZE + slot * _SLOT_SIZE) // 8
            calls = self._words[word + 1]
            out.append((self._words[word], calls) if calls else None)
        return out

    def close(self) -> None:
        """Unmap and remove the file. Idempotent."""
        if not self._map.closed:
            self._words.release()
            self._map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

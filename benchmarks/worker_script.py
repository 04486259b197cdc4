"""The training-worker stand-in of the worker-failure benchmark (standard library only).

Run by the agent under test as ``worker_script.py DIR``. It writes ``DIR/start-<pid>``
holding ``"<pid> <rank> <time.monotonic()>"`` as soon as it runs, so the harness sees when
each worker started (attempts are told apart by time: an agent restarted for a membership
change does not count a restart, so ``TORCHELASTIC_RESTART_COUNT`` cannot tell them).
The worker with global rank 1, while ``DIR/exit`` does not exist, then blocks on the
FIFO ``DIR/fail.fifo``; when the harness writes to it, the worker writes ``DIR/exit``
(its exit time) and exits with code 1. Every other worker waits for a signal (its agent
stops it).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _stamp(path: Path, rank: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()} {rank} {time.monotonic()!r}\n")
    # Rename so the harness never reads a half-written file.
    tmp.replace(path)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    rank = int(os.environ.get("RANK", "-1"))
    _stamp(out / f"start-{os.getpid()}", rank)
    if rank == 1 and not (out / "exit").exists():
        with open(out / "fail.fifo") as fifo:
            fifo.read(1)
        _stamp(out / "exit", rank)
        return 1
    signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

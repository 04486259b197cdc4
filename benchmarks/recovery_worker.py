"""The training worker of the recovery benchmark: a real torch worker, stamped.

Run by the agent under test (ours or torchrun) as ``recovery_worker.py DIR CHECKPOINT``.
It appends one JSON line per milestone to ``DIR/w-<pid>.jsonl``, each written with one
``os.write`` as soon as it is reached (a worker killed later keeps what it wrote)::

    start      first line, before anything is imported
    imported   after ``import torch`` and ``torch.distributed``
    pg         after ``init_process_group`` (gloo)
    checkpoint after ``torch.load`` of CHECKPOINT
    step1      after the first all_reduce completed (its result checked)
    fail       the crashing worker, right before ``os._exit(1)``

Each line has ``ev``, ``mono`` (``time.monotonic()``: one clock for every process of
the machine), ``wall`` and the worker's ``rank``, ``world``, ``restart``
(``TORCHELASTIC_RESTART_COUNT``) and ``round`` (``ETCD_ELASTIC_ROUND``, ours only).
Then one all_reduce per step, every ``RECOVERY_STEP_INTERVAL`` seconds (default 0.1).
The worker of global rank ``RECOVERY_CRASH_RANK`` (default 1) crashes at its next step
once ``DIR/crash`` exists: it takes the file (a rename, so one worker takes it once),
stamps ``fail`` and exits 1 without cleanup.
"""

import time

_T0 = (time.monotonic(), time.time())

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

_FD = -1
_ENV = os.environ


def _stamp(event: str, mono: float | None = None, wall: float | None = None) -> None:
    line = {
        "ev": event,
        "mono": time.monotonic() if mono is None else mono,
        "wall": time.time() if wall is None else wall,
        "pid": os.getpid(),
        "rank": int(_ENV.get("RANK", "-1")),
        "world": int(_ENV.get("WORLD_SIZE", "-1")),
        "restart": int(_ENV.get("TORCHELASTIC_RESTART_COUNT", "-1")),
        "round": int(_ENV.get("ETCD_ELASTIC_ROUND", "-1")),
    }
    os.write(_FD, (json.dumps(line) + "\n").encode())


def main(argv: list[str]) -> int:
    global _FD
    out, checkpoint = argv[0], argv[1]
    _FD = os.open(
        os.path.join(out, f"w-{os.getpid()}.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    _stamp("start", *_T0)

    import torch
    import torch.distributed as dist

    _stamp("imported")
    dist.init_process_group(backend="gloo")
    _stamp("pg")
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or "weights" not in state:
        raise SystemExit(f"{checkpoint}: not a checkpoint of the recovery benchmark")
    _stamp("checkpoint")

    rank, world = dist.get_rank(), dist.get_world_size()
    crash_rank = int(_ENV.get("RECOVERY_CRASH_RANK", "1"))
    interval = float(_ENV.get("RECOVERY_STEP_INTERVAL", "0.1"))
    crash = os.path.join(out, "crash")
    step = 0
    while True:
        if rank == crash_rank and os.path.exists(crash):
            try:
                os.rename(crash, os.path.join(out, f"crashed-{os.getpid()}"))
            except FileNotFoundError:
                pass
            else:
                _stamp("fail")
                os._exit(1)
        grad = torch.ones(4)
        dist.all_reduce(grad)
        if float(grad[0]) != world:
            raise SystemExit(f"all_reduce gave {float(grad[0])}, expected {world}")
        step += 1
        if step == 1:
            _stamp("step1")
        time.sleep(interval)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

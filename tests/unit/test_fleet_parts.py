"""The fleet harness's parts that need no etcd: the stand-in workers (against the agent's
own progress reader and hang-detection helpers), etcd's counters, the layout, the
windows' bookkeeping, and the cost model's fit."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.health.hang import running_ranks
from agent.observe.metrics import running_workers
from agent.workers.launch import WorkerLaunch, WorkerRanks
from agent.workers.logs import StreamPlan, WorkerLogs
from agent.workers.state import WorkerState
from benchmarks.fleet.etcd_metrics import Reading, change, leader_of, parse
from benchmarks.fleet.fleet import AgentStart
from benchmarks.fleet.measure import cpu_bound, training_seconds
from benchmarks.fleet.model import Fit, fit, own_cost, phase_points, renewals_per_ttl, ttl_advice
from benchmarks.fleet.phases import formed_after, where_they_are
from benchmarks.fleet.report import LargeFormation, _large_formation, render, targets
from benchmarks.fleet.run import layout, pick_slots
from benchmarks.fleet.standin import ProgressSlot, StandInCheck, StandInGroup, Trainer
from etcd_elastic.progress import PROGRESS_FILE_ENV, ProgressFile

# -- stand-in workers -------------------------------------------------------------------


def _launch(local_rank: int, progress: str) -> WorkerLaunch:
    plan = StreamPlan(file=None, console=False)
    return WorkerLaunch(
        ranks=WorkerRanks(local_rank, local_rank, local_rank, 2, 2),
        argv=["stand-in"],
        env={PROGRESS_FILE_ENV: progress, "LOCAL_RANK": str(local_rank)},
        logs=WorkerLogs(stdout=plan, stderr=plan, error_file="", prefix=""),
    )


def test_progress_slot_is_read_by_the_agents_own_reader() -> None:
    progress = ProgressFile(2)
    try:
        slot = ProgressSlot(progress.path, 1)
        assert progress.read() == [None, None]
        slot.report(7)
        slot.report(8)
        assert progress.read() == [None, (8, 2)]  # the step and the count of calls
        slot.close()
    finally:
        progress.close()


def test_progress_slot_refuses_a_rank_the_file_has_no_slot_for() -> None:
    progress = ProgressFile(1)
    try:
        with pytest.raises(ValueError, match="slot for local rank 3"):
            ProgressSlot(progress.path, 3)
    finally:
        progress.close()


def test_stand_in_group_runs_fails_and_stops_as_a_worker_group_does() -> None:
    progress = ProgressFile(2)
    trainer = Trainer(step_s=0.01, epoch=time.monotonic())
    woken = threading.Event()
    seen: list[str] = []
    group = StandInGroup(
        [_launch(0, progress.path), _launch(1, progress.path)],
        woken.set,
        trainer,
        on_start=lambda g: seen.append("start"),
        on_stop=lambda g: seen.append("stop"),
    )
    try:
        assert group.state() is WorkerState.INIT
        group.start()
        assert group.state() is WorkerState.HEALTHY
        assert running_ranks(group) == frozenset({0, 1})  # hang detection's own helper
        assert running_workers(group) == 2  # the metrics' own helper
        deadline = time.monotonic() + 10
        while None in progress.read() and time.monotonic() < deadline:
            time.sleep(0.01)  # the trainer's thread reports on its own clock
        assert None not in progress.read()
        group.exit_worker(1, 1)
        assert woken.is_set()
        assert group.state() is WorkerState.FAILED
        assert group.exits()[1].returncode == 1
        group.stop(0.0)
        assert group.state() is WorkerState.STOPPED
        assert running_ranks(group) == frozenset()
        assert seen == ["start", "stop"]
    finally:
        trainer.close()
        progress.close()


@contextlib.contextmanager
def _one_worker_group() -> Iterator[tuple[StandInGroup, ProgressFile]]:
    """A stand-in group of one worker reporting into its own progress file, closed after."""
    progress = ProgressFile(1)
    trainer = Trainer(step_s=0.01, epoch=time.monotonic())
    group = StandInGroup(
        [_launch(0, progress.path)],
        lambda: None,
        trainer,
        on_start=lambda g: None,
        on_stop=lambda g: None,
    )
    try:
        yield group, progress
    finally:
        trainer.close()
        progress.close()


def test_stand_in_group_succeeds_when_every_worker_exits_0() -> None:
    with _one_worker_group() as (group, _):
        group.start()
        group.exit_all(0)
        assert group.state() is WorkerState.SUCCEEDED
        with pytest.raises(RuntimeError, match="already started"):
            group.start()


def test_a_group_started_after_the_training_is_over_exits_0_at_once() -> None:
    """After the harness's finish, an agent that re-formed starts workers that find the
    training over (a script resuming from its last checkpoint), not ones that run on."""
    progress = ProgressFile(1)
    trainer = Trainer(step_s=0.01, epoch=time.monotonic())
    woken = threading.Event()
    over = threading.Event()
    group = StandInGroup(
        [_launch(0, progress.path)], woken.set, trainer,
        on_start=lambda g: None, on_stop=lambda g: None, over=over.is_set,
    )  # fmt: skip
    later = StandInGroup(
        [_launch(0, progress.path)], woken.set, trainer,
        on_start=lambda g: None, on_stop=lambda g: None, over=over.is_set,
    )  # fmt: skip
    try:
        group.start()
        assert group.state() is WorkerState.HEALTHY
        over.set()
        later.start()
        assert later.state() is WorkerState.SUCCEEDED
        assert woken.is_set()
        assert group.state() is WorkerState.HEALTHY  # finish itself ends the running ones
    finally:
        trainer.close()
        progress.close()


def test_stalled_stand_in_reports_nothing_more() -> None:
    with _one_worker_group() as (group, progress):
        group.start()
        deadline = time.monotonic() + 10
        while progress.read()[0] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        group.stall()
        time.sleep(0.05)  # let a step that was under way land
        before = progress.read()[0]
        time.sleep(0.1)
        assert progress.read()[0] == before


def test_stand_in_check_passes_with_the_rank_it_was_given() -> None:
    data, why = StandInCheck({}).run({"rank": 3, "node_id": "n", "addr": "a"}, timeout=1.0)
    assert why == ""
    assert data is not None and data["group_rank"] == 3 and data["error"] == ""


# -- etcd's counters --------------------------------------------------------------------

_PAGE = """# HELP x
etcd_server_is_leader {leader}
etcd_server_proposals_committed_total {writes}
etcd_debugging_lease_renewed_total {renewed}
etcd_debugging_mvcc_events_total {events}
etcd_mvcc_db_total_size_in_bytes 4096
grpc_server_handled_total{{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"}} {ranges}
grpc_server_handled_total{{grpc_code="NotFound",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"}} 1
grpc_server_msg_received_total{{grpc_method="Watch",grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"}} {watch}
grpc_server_msg_received_total{{grpc_method="Watch",grpc_service="grpc.health.v1.Health",grpc_type="server_stream"}} 50
"""  # noqa: E501


def _page(**values: float) -> dict[str, float]:
    return parse(_PAGE.format(**values))


def test_change_reads_writes_on_the_leader_and_sums_requests_over_members() -> None:
    zero = {"writes": 10, "renewed": 0, "events": 0, "ranges": 0, "watch": 0}
    before = Reading((_page(leader=0, **zero), _page(leader=1, **zero)), 1)
    after = Reading(
        (
            _page(leader=0, writes=15, renewed=0, events=3, ranges=4, watch=2),
            _page(leader=1, writes=15, renewed=9, events=5, ranges=6, watch=1),
        ),
        1,
    )
    out = change(before, after)
    assert out["writes"] == 5  # applied by both: counted once
    assert out["keepalives"] == 9  # the leader renews
    assert out["watch_events"] == 8  # each member sends its own
    assert out["rpc_Range"] == 10  # codes summed, members summed
    assert out["msgs_Watch"] == 3  # the health service's Watch is not etcd's
    assert out["db_size_end"] == 4096 and out["leader_changed"] == 0


def test_leader_is_the_member_that_says_so() -> None:
    assert leader_of([{"etcd_server_is_leader": 0.0}, {"etcd_server_is_leader": 1.0}]) == 1
    assert leader_of([{}, {}]) == 0


# -- layout and windows -------------------------------------------------------------------


def test_layout_keeps_one_agent_alone_and_deals_the_rest() -> None:
    assert layout(10, 2) == [1, 5, 4]
    assert layout(1000, 0) == [1, 125, 125, 125, 125, 125, 125, 125, 124]
    assert sum(layout(100, 0)) == 100
    with pytest.raises(ValueError, match="at least 3"):
        layout(2, 0)


def test_pick_slots_comes_closest_to_the_target_with_fewest_slots() -> None:
    sizes = [1, 125, 125, 125, 125, 125, 125, 125, 124]
    picked = pick_slots(sizes, 500)
    assert sum(sizes[i] for i in picked) == 500 and len(picked) == 4
    assert pick_slots([1, 5, 4], 5) == [1]
    assert pick_slots([1, 5, 4], 5, avoid=[1]) == [0, 2]


def test_training_seconds_counts_each_run_inside_the_window() -> None:
    # started at 1, stopped at 3; started again at 4, killed at 6; window 2..10
    assert training_seconds([1.0, 4.0], [3.0], 6.0, 2.0, 10.0) == pytest.approx(3.0)
    # still running at the window's end
    assert training_seconds([1.0], [], None, 0.0, 5.0) == pytest.approx(4.0)
    assert training_seconds([], [], None, 0.0, 5.0) == 0.0


def _start(agent: int, round: int, world: int) -> AgentStart:
    return AgentStart(agent, "run", round, agent, world, None, 0.0)


def test_formed_after_wants_every_agent_in_one_new_round_of_all_of_them() -> None:
    full = [_start(0, 2, 2), _start(1, 2, 2)]
    assert formed_after(full, 1)
    assert not formed_after(full, 2)  # not after round 2
    assert not formed_after([_start(0, 2, 1), None], 1)  # one never started
    assert not formed_after([_start(0, 2, 2), _start(1, 3, 2)], 1)  # two rounds


def test_where_they_are_says_how_far_a_formation_got() -> None:
    latest = [_start(0, 1, 2), _start(1, 1, 2), None]
    assert where_they_are(latest) == "2 training in round 1 of 2, 1 never started"
    assert where_they_are([]) == "nobody"


def test_cpu_bound_names_the_busiest_only_when_the_machine_was_full() -> None:
    assert cpu_bound(10.0, 2, 0.5, 0.3, 0.1) == "waits"
    assert cpu_bound(10.0, 2, 1.95, 1.2, 0.6) == "hosts"
    assert cpu_bound(10.0, 2, 1.95, 0.2, 1.5) == "etcd"
    assert cpu_bound(10.0, 2, 1.95, 0.2, 0.2) == "other"


# -- the model ------------------------------------------------------------------------


def test_fit_of_a_line_is_that_line() -> None:
    f = fit([(10, 25.0), (100, 205.0), (1000, 2005.0)])
    assert not f.superlinear
    assert f.b == pytest.approx(2.0) and f.a == pytest.approx(5.0)
    assert f.formula() == "2·N + 5"


def test_fit_of_a_square_is_superlinear_and_goes_through_the_points() -> None:
    points = [(10.0, 100.0 + 10), (100.0, 10_000.0 + 100), (1000.0, 1_000_000.0 + 1000)]
    f = fit(points)
    assert f.superlinear
    for n, v in points:
        assert f.at(n) == pytest.approx(v)
    assert "N²" in f.formula()


def _run(n: int, steady_writes: float, formation_writes: float) -> dict[str, Any]:
    def phase(name: str, writes: float, window: float, training: float) -> dict[str, Any]:
        return {
            "phase": name,
            "nodes": n,
            "window_s": window,
            "etcd": {"writes": writes, "keepalives": 0.6 * n * window},
            "times": {"training_node_s": training, "formed_s": 0.1, "first_round_complete": 1.0},
            "harness": {},
        }

    return {
        "nodes": n,
        "options": {"lease_ttl": 5},
        "etcd": "etcd 3.5.1",
        "phases": [
            phase("formation", formation_writes, 2.0, n * 1.0),
            phase("steady", steady_writes * n * 10, 10.0, n * 10.0),
        ],
        "leftovers": {},
        "churn": {},
        "errors": [],
    }


def test_own_cost_takes_the_training_in_the_window_out() -> None:
    run = _run(10, steady_writes=1.0, formation_writes=40.0)
    formation = run["phases"][0]
    # 10 node-seconds of training at 1 write each: 40 - 10
    assert own_cost(formation, {"writes": 1.0}, "writes") == pytest.approx(30.0)
    assert own_cost(run["phases"][1], {}, "writes") == pytest.approx(10.0)  # per second


def test_phase_points_model_and_ttl_advice_from_runs() -> None:
    runs = [_run(n, 1.0, 3.0 * n + n) for n in (10, 100, 1000)]
    points = phase_points(runs)
    f = fit(points["formation"]["writes"])
    assert f.b == pytest.approx(3.0)  # 4N written, N of it training
    assert renewals_per_ttl(runs) == pytest.approx(3.0)  # 0.6 a second at TTL 5
    advice = dict(ttl_advice(3.0))
    assert advice[5] == 1666 and advice[15] == 5000
    text = render(runs, ceiling=10_000.0, formation=(0.05, 1.0, 20.0))
    assert "3·N" in text and "10,000" in text and "formation N=32" in text


def test_fit_formula_of_nothing_is_zero() -> None:
    assert Fit(0.0, 0.0, 0.0, 0.0).formula() == "0"


def test_the_large_formation_is_judged_against_twenty_times_the_ceiling(tmp_path: Path) -> None:
    def scenario(median: float, samples: int, errors: int) -> LargeFormation | None:
        path = tmp_path / "formation-1000.json"
        ours = {"median": median, "n": samples, "errors": ["timed out"] * errors}
        path.write_text(json.dumps({"point": "N=1000", "systems": {"etcd-v3": ours}}))
        return _large_formation(path)

    # 1000 transactions at 10,000/s take 0.1 s: the bound is 2 s
    met = targets([], 10_000.0, (None, None, None), scenario(1.9, 5, 0))
    assert met == [
        "formation N=1000 (`python -m benchmarks formation`): 5 of 5 runs formed, median "
        "1.90 s; 1000 transactions at etcd's ceiling (10000/s) take 0.100 s, x20 = 2.00 s: met"
    ]
    assert targets([], 10_000.0, (None, None, None), scenario(2.1, 5, 0))[0].endswith("**missed**")
    one_failed = targets([], 10_000.0, (None, None, None), scenario(1.0, 4, 1))[0]
    assert "4 of 5 runs formed" in one_failed and one_failed.endswith("**missed**")

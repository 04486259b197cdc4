"""The pre-flight check's pure parts: the pair schedule, the result codec and the verdict."""

from __future__ import annotations

import itertools

import pytest

from agent.health.verdict import (
    NodeResult,
    PairTime,
    Thresholds,
    decode_result,
    encode_result,
    judge,
    pair_schedule,
    pairs_of,
)

MEMBERS = [(f"n{i}", f"10.0.0.{i}") for i in range(8)]


def _ring_results(
    n: int,
    matmul: dict[int, float] | None = None,
    pair: dict[tuple[int, int], float | None] | None = None,
    errors: dict[int, str] | None = None,
) -> dict[int, NodeResult]:
    """Every node's result: matmul 0.01 s and pairs 0.02 s unless given otherwise."""
    matmul, pair, errors = matmul or {}, pair or {}, errors or {}
    out = {}
    for rank in range(n):
        pairs = []
        for a, b in pairs_of(n, rank):
            peer = b if rank == a else a
            seconds = pair.get((min(a, b), max(a, b)), 0.02)
            pairs.append(PairTime(peer, seconds, "" if seconds is not None else "timed out"))
        out[rank] = NodeResult(
            rank, f"n{rank}", f"10.0.0.{rank}", error=errors.get(rank, ""), devices="cpu",
            matmul_s=matmul.get(rank, 0.01), pairs=tuple(pairs), took_s=0.1,
        )  # fmt: skip
    return out


@pytest.mark.parametrize("n", range(1, 10))
def test_the_schedule_covers_the_ring_in_phases_of_disjoint_pairs(n: int) -> None:
    phases = pair_schedule(n)
    pairs = [p for phase in phases for p in phase]
    expected = {(0, 1)} if n == 2 else {(i, (i + 1) % n) for i in range(n)} if n > 2 else set()
    assert set(pairs) == expected and len(pairs) == len(expected)
    assert len(phases) <= 3
    for phase in phases:
        nodes = [x for p in phase for x in p]
        assert len(nodes) == len(set(nodes)), phase
    for rank in range(n):
        mine = pairs_of(n, rank)
        assert len(mine) == (0 if n == 1 else 1 if n == 2 else 2)


def test_everyone_passes_when_nobody_stands_out() -> None:
    verdict = judge(MEMBERS[:4], _ring_results(4))
    assert verdict.failed == ()
    assert verdict.matmul_ref_s == 0.01 and verdict.pair_ref_s == 0.02


def test_noise_under_the_floor_passes_even_at_many_times_the_median() -> None:
    # 0.4 s against 0.01 s is 40x, but 0.39 s over: below the 0.5 s floor.
    verdict = judge(MEMBERS[:3], _ring_results(3, matmul={2: 0.4}))
    assert verdict.failed == ()
    # Slow but not 3x: 1.2 s against 0.5 s.
    verdict = judge(MEMBERS[:3], _ring_results(3, matmul={0: 0.5, 1: 0.5, 2: 1.2}))
    assert verdict.failed == ()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_a_slow_matmul_fails_its_node(n: int) -> None:
    verdict = judge(MEMBERS[:n], _ring_results(n, matmul={1: 3.0}))
    assert [(v.group_rank, v.reason) for v in verdict.failed] == [
        (1, "matmul 3.000 s, 300x the median 0.010 s; limit 3x and +0.5 s")
    ]


@pytest.mark.parametrize("n", [3, 4, 5, 6])
def test_the_node_slow_in_all_its_pairs_is_blamed_not_its_neighbours(n: int) -> None:
    slow = 2
    pairs = {(min(a, b), max(a, b)): 4.0 for a, b in pairs_of(n, slow)}
    verdict = judge(MEMBERS[:n], _ring_results(n, pair=pairs))
    assert [v.group_rank for v in verdict.failed] == [slow]
    assert verdict.failed[0].reason == (
        "all_reduce with its neighbours 4.000 s at best, 200x the median 0.020 s; "
        "limit 3x and +0.5 s"
    )


def test_with_two_nodes_a_slow_or_broken_link_blames_nobody() -> None:
    assert judge(MEMBERS[:2], _ring_results(2, pair={(0, 1): 5.0})).failed == ()
    assert judge(MEMBERS[:2], _ring_results(2, pair={(0, 1): None})).failed == ()


def test_a_node_whose_every_pair_failed_is_blamed() -> None:
    pairs = {(2, 3): None, (1, 2): None}
    verdict = judge(MEMBERS[:4], _ring_results(4, pair=pairs))
    assert [(v.group_rank, v.reason) for v in verdict.failed] == [
        (2, "every all_reduce with its neighbours failed (timed out; timed out)")
    ]


def test_errors_and_missing_results_fail_and_leave_the_others_judged_by_the_rest() -> None:
    results = _ring_results(4, errors={3: "devices: RuntimeError: cuda:1 computed a wrong sum"})
    del results[1]
    verdict = judge(MEMBERS[:4], results, missing="no result within 40 s")
    assert [(v.group_rank, v.node_id, v.reason) for v in verdict.failed] == [
        (1, "n1", "no result within 40 s"),
        (3, "n3", "devices: RuntimeError: cuda:1 computed a wrong sum"),
    ]
    # Nodes 0 and 2 each had a pair with a failed node and another that worked.
    assert [v.passed for v in verdict.nodes] == [True, False, True, False]


def test_thresholds_are_parameters() -> None:
    strict = Thresholds(factor=1.5, floor_s=0.0)
    verdict = judge(MEMBERS[:3], _ring_results(3, matmul={0: 0.01, 1: 0.01, 2: 0.02}), strict)
    assert [v.group_rank for v in verdict.failed] == [2]


def test_lines_and_events_name_every_node() -> None:
    verdict = judge(MEMBERS[:3], _ring_results(3, matmul={1: 3.0}))
    assert [v.line() for v in verdict.nodes] == [
        "node 0 n0 (10.0.0.0): devices cpu, matmul 0.010 s, pairs [0-1=0.020 s 0-2=0.020 s], "
        "check 0.10 s; passed",
        "node 1 n1 (10.0.0.1): devices cpu, matmul 3.000 s, pairs [1-0=0.020 s 1-2=0.020 s], "
        "check 0.10 s; FAILED: matmul 3.000 s, 300x the median 0.010 s; limit 3x and +0.5 s",
        "node 2 n2 (10.0.0.2): devices cpu, matmul 0.010 s, pairs [2-1=0.020 s 2-0=0.020 s], "
        "check 0.10 s; passed",
    ]
    missing = judge(MEMBERS[:2], {0: _ring_results(2)[0]})
    assert missing.nodes[1].line() == "node 1 n1 (10.0.0.1): no result; FAILED: no result"
    events = verdict.events()
    assert [e["passed"] for e in events] == [True, False, True]
    assert events[1] == {
        "group_rank": 1, "node_id": "n1", "addr": "10.0.0.1", "passed": False,
        "reason": verdict.nodes[1].reason, "devices": "cpu", "matmul_s": 3.0,
        "best_pair_s": 0.02, "check_s": 0.1,
    }  # fmt: skip


def test_results_round_trip_and_garbage_is_refused_naming_the_key() -> None:
    for result in itertools.chain(_ring_results(3).values(), [NodeResult(0, "x", "", "boom")]):
        assert decode_result("k", encode_result(result).encode()) == result
    bad = [
        (b"\xff", "not a health-check result ('utf-8' codec can't decode byte 0xff"),
        (b"[]", "not a health-check result (not a JSON object: [])"),
        (b'{"group_rank": "0"}', "not a health-check result (group_rank is not a whole number"),
        (b'{"group_rank": 0, "matmul_s": "fast"}', "matmul_s is not a number of seconds: 'fast'"),
        (b'{"group_rank": 0, "pairs": [{"peer": 1, "seconds": true}]}',
         "a pair is not a number of seconds: True"),
    ]  # fmt: skip
    for raw, text in bad:
        with pytest.raises(ValueError) as info:
            decode_result("etcd_elastic/health/0", raw)
        assert str(info.value).startswith("store key 'etcd_elastic/health/0': ")
        assert text in str(info.value)

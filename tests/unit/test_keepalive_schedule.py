"""When the leases on one keep-alive stream send (coordinator.core.etcd_client._schedule).

Times are plain numbers: nothing sleeps or reads a clock. The last tests replay the
schedule against a model of etcd's gRPC proxy, which answers a keep-alive only with its
own next renewal of the lease (due ttl/3 after its last one, on a 0.5 s tick).
"""

from __future__ import annotations

import math

import pytest

from coordinator.core.etcd_client._schedule import OnStream, Schedule, Step, leases_text, pace

SEND, CHECK = Step.SEND, Step.CHECK


def test_a_new_lease_sends_at_once_and_is_checked_an_interval_later() -> None:
    schedule = Schedule()
    schedule.add(1, 2.0, now=10.0)
    assert schedule.next_at() == 10.0
    assert schedule.due(10.0) == [(1, SEND)]
    assert schedule.due(10.0) == []  # handed out once
    schedule.sent(1, 10.0)
    assert schedule.next_at() == 12.0
    assert schedule.due(11.9) == []
    assert schedule.due(12.0) == [(1, CHECK)]


def test_the_next_keep_alive_follows_the_answer_not_the_clock() -> None:
    schedule = Schedule()
    schedule.add(1, 2.0, now=0.0)
    schedule.due(0.0)
    schedule.sent(1, 0.0)
    schedule.answered(1, 0.7)  # a slow answer: the next one waits for it
    assert schedule.next_at() == pytest.approx(0.7 + pace(2.0))
    assert schedule.due(2.0) == []
    assert schedule.due(0.7 + pace(2.0)) == [(1, SEND)]


def test_while_a_keep_alive_is_unanswered_no_other_goes_out_for_that_lease() -> None:
    schedule = Schedule()
    schedule.add(1, 1.0, now=0.0)
    schedule.due(0.0)
    schedule.sent(1, 0.0)
    assert schedule.due(1.0) == [(1, CHECK)]
    schedule.not_hung(1, 1.0)  # slow, not hung: checked again, nothing sent
    assert schedule.due(1.4) == []
    assert schedule.due(1.5) == [(1, CHECK)]
    schedule.not_hung(1, 1.5)
    schedule.answered(1, 1.6)
    assert schedule.due(1.6 + pace(1.0)) == [(1, SEND)]


def test_an_answer_nothing_waits_for_changes_only_the_interval() -> None:
    schedule = Schedule()
    schedule.add(1, 1.0, now=0.0)
    schedule.answered(1, 0.0, interval=2.0)  # its first keep-alive is not even out yet
    assert schedule.due(0.0) == [(1, SEND)]
    schedule.sent(1, 0.0)
    assert schedule.due(1.9) == []
    assert schedule.due(2.0) == [(1, CHECK)]  # the new interval


def test_steps_out_of_turn_change_nothing() -> None:
    schedule = Schedule()
    schedule.add(1, 1.0, now=0.0)
    schedule.not_hung(1, 0.0)  # nothing was checked
    schedule.answered(1, 0.0)  # nothing was sent
    assert schedule.due(0.0) == [(1, SEND)]
    schedule.sent(1, 0.0)
    schedule.sent(1, 0.1)  # it was not due
    assert schedule.due(0.99) == [] and schedule.due(1.0) == [(1, CHECK)]


def test_leases_are_paced_each_by_its_own_interval_and_removal_is_final() -> None:
    schedule = Schedule()
    schedule.add(1, 1.0, now=0.0)
    schedule.add(2, 3.0, now=0.0)
    schedule.add(3, 1.0, now=0.0)
    assert sorted(schedule.due(0.0)) == [(1, SEND), (2, SEND), (3, SEND)]
    for lease in (1, 2, 3):
        schedule.sent(lease, 0.0)
    schedule.remove(3)
    assert 3 not in schedule and len(schedule) == 2
    assert schedule.due(1.0) == [(1, CHECK)]
    schedule.answered(3, 1.0)  # a late answer for a removed lease
    assert schedule.due(2.9) == []
    assert schedule.due(3.0) == [(2, CHECK)]
    schedule.remove(1)
    schedule.remove(2)
    assert schedule.next_at() is None


def test_pace_is_a_little_under_the_interval() -> None:
    assert pace(1.0) == pytest.approx(0.95)
    assert pace(5 / 3) == pytest.approx(5 / 3 - 1 / 12)
    assert pace(10.0) == pytest.approx(9.9)  # at most 0.1 s early: renewals stay ttl/3
    assert pace(0.1) == pytest.approx(0.095)


def test_a_stream_keeps_each_keepalives_number_and_schedule() -> None:
    stream = OnStream(1, "10.0.0.2:2379")
    stream.join(7, 3, 1.0, now=5.0)
    assert stream.numbers == {7: 3} and stream.schedule.due(5.0) == [(7, SEND)]
    stream.leave(7)
    assert stream.numbers == {} and len(stream.schedule) == 0


def test_answers_for_one_lease_go_to_its_owners_in_the_order_they_asked() -> None:
    # Two owners of lease 0xA (slots 1 and 2) and one of 0xB (slot 3): etcd answers a
    # stream's requests in order and names only the lease.
    stream = OnStream(0, "10.0.0.1:2379")
    for slot in (1, 2, 3):
        stream.join(slot, 1, 1.0, now=0.0)
    stream.sent(0xA, 2)
    stream.sent(0xB, 3)
    stream.sent(0xA, 1)
    assert stream.answered(0xA) == 2
    assert stream.answered(0xB) == 3
    stream.leave(1)  # closed while its keep-alive was out: the answer goes to nobody
    assert stream.answered(0xA) is None
    assert stream.answered(0xA) is None  # nothing was waiting


def test_leases_text_names_three_and_counts_the_rest() -> None:
    assert leases_text([0x1A]) == "1a"
    assert leases_text([0x3, 0x1, 0x2]) == "1, 2, 3"
    assert leases_text(range(1, 11), ",") == "1,2,3 and 7 more"
    assert leases_text([]) == ""


# -- against a model of etcd's gRPC proxy --------------------------------------------------


def _proxy_renewal_after(last: float, interval: float, phase: float) -> float:
    """The proxy's next own renewal: ``interval`` after its last one, on its next 0.5 s
    tick (etcd's clientv3 lessor, which the proxy runs, sends due keep-alives on a tick)."""
    due = last + interval
    return phase + 0.5 * math.ceil((due - phase) / 0.5)


@pytest.mark.parametrize("ttl", [2, 3, 5, 10, 30])
@pytest.mark.parametrize("phase", [0.0, 0.13, 0.37])
def test_through_the_proxy_no_keep_alive_waits_an_interval(ttl: int, phase: float) -> None:
    """The proxy answers each keep-alive with its first renewal after the keep-alive
    arrived. Paced by answers, and sent before the proxy's next renewal, a keep-alive
    waits at most a tick plus the lead of :func:`pace`, below the interval after which
    the member counts as hung (ttl 2: 0.53 s of 0.67 s). Sent ttl/3 after the last
    answer instead, it would race that renewal and, losing, wait a whole proxy period."""
    interval = ttl / 3
    schedule = Schedule()
    schedule.add(1, interval, now=0.0)
    # The first keep-alive starts the proxy's renewals of the lease: the first on its
    # next tick.
    renewal = phase + 0.5 * (math.floor(-phase / 0.5) + 1)
    now, waits = 0.0, []
    for _ in range(200):
        assert schedule.due(now) == [(1, SEND)]
        schedule.sent(1, now)
        while renewal <= now:  # renewals before the keep-alive arrived do not answer it
            renewal = _proxy_renewal_after(renewal, interval, phase)
        waits.append(renewal - now)
        schedule.answered(1, renewal)
        next_at = schedule.next_at()
        assert next_at is not None
        now = next_at
    assert max(waits) <= 0.5 + (interval - pace(interval)) + 1e-9, max(waits)
    assert max(waits) < interval

"""The pure rules of a lease's keep-alive (coordinator.core.etcd_client._liveness).

Times are plain numbers: nothing here sleeps or reads a clock. The rule under test is
DESIGN §4's: a lease is LOST only when etcd says so; silence only makes it UNREACHABLE.
"""

from __future__ import annotations

import pytest

from coordinator.core.etcd_client import LeaseState, Outage
from coordinator.core.etcd_client._leases import earlier_grant_applied
from coordinator.core.etcd_client._liveness import Change, Liveness, Probe, watch_probe

ALIVE, UNREACHABLE, LOST = LeaseState.ALIVE, LeaseState.UNREACHABLE, LeaseState.LOST
FAILED, CLOSED = LeaseState.FAILED, LeaseState.CLOSED


def _answered_at(live: Liveness, sent: float, answer: float, ttl: int = 5) -> Change | None:
    stream = live.new_stream()
    live.sent(stream, sent)
    return live.answered(answer, ttl)


def test_a_new_lease_is_alive_for_its_ttl_from_the_grant() -> None:
    live = Liveness(0xAB, 5, granted_at=100.0)
    assert live.state is ALIVE and live.alive_until == 105.0
    assert live.check(104.9) is None
    assert live.check(105.0) == Change(UNREACHABLE, 5.0)


def test_an_answer_renews_from_its_requests_send_time_not_from_its_arrival() -> None:
    live = Liveness(1, 5, granted_at=0.0)
    stream = live.new_stream()
    live.sent(stream, 1.0)
    live.sent(stream, 2.0)
    # etcd answers a stream's requests in order: the first answer is for the 1.0 request,
    # however late it arrives.
    assert live.answered(2.5, 5) is None
    assert live.alive_until == 6.0
    assert live.answered(2.6, 5) is None
    assert live.alive_until == 7.0
    assert live.oldest_unanswered() is None


def test_requests_of_an_old_stream_do_not_count_on_the_new_one() -> None:
    live = Liveness(1, 5, granted_at=0.0)
    old = live.new_stream()
    live.sent(old, 1.0)
    new = live.new_stream()  # the old stream broke; its request will never be answered
    assert live.oldest_unanswered() is None
    live.sent(old, 1.5)  # a request generator that outlived its stream by a moment
    assert live.oldest_unanswered() is None
    live.sent(new, 2.0)
    assert live.oldest_unanswered() == 2.0


@pytest.mark.parametrize("silence", [5.0, 15.0, 70.0, 3600.0])
def test_silence_of_any_length_is_unreachable_never_lost(silence: float) -> None:
    live = Liveness(1, 5, granted_at=0.0)
    changes = [live.check(t / 10) for t in range(0, int(silence * 10) + 1)]
    assert [c for c in changes if c is not None] == [Change(UNREACHABLE, 5.0)]
    assert live.state is UNREACHABLE and live.lost_reason == ""


def test_etcd_answering_again_makes_it_alive_and_reports_the_silence() -> None:
    live = Liveness(1, 5, granted_at=0.0)
    assert _answered_at(live, 1.0, 1.5) is None  # alive until 6.0
    assert live.check(6.0) == Change(UNREACHABLE, 4.5)
    # Fifteen seconds of silence, then an answer with the lease alive (the restarted
    # cluster's new leader extended it).
    assert _answered_at(live, 16.0, 16.5) == Change(ALIVE, 15.0)
    assert live.state is ALIVE and live.alive_until == 21.0
    assert _answered_at(live, 17.0, 17.5) is None  # reported once, not per answer


@pytest.mark.parametrize("ttl", [0, -1])
def test_a_keepalive_answer_of_ttl_0_or_less_is_lost(ttl: int) -> None:
    live = Liveness(1, 5, granted_at=0.0)
    assert _answered_at(live, 1.0, 1.2, ttl=ttl) == Change(LOST, 1.2)
    assert live.state is LOST and live.lost_reason == "etcd says it expired or was revoked"
    # Final: nothing brings it back, and no later change is reported.
    assert _answered_at(live, 2.0, 2.1) is None and live.check(100.0) is None
    assert live.end(CLOSED, 101.0, "closed") is None and live.state is LOST


def test_lost_is_reported_the_same_after_an_outage() -> None:
    live = Liveness(1, 5, granted_at=0.0)
    assert live.check(5.0) == Change(UNREACHABLE, 5.0)
    assert _answered_at(live, 30.0, 30.1, ttl=0) == Change(LOST, 30.1)


@pytest.mark.parametrize(
    ("remaining", "state", "alive_until"),
    [
        (-1, LOST, 5.0),  # etcd's time-to-live of a lease it does not have
        (0, ALIVE, 10.0),  # whole seconds, rounded down: under a second left, but alive
        (3, ALIVE, 13.0),
    ],
)
def test_a_time_to_live_probe(remaining: int, state: LeaseState, alive_until: float) -> None:
    live = Liveness(1, 5, granted_at=0.0)
    live.check(5.0)
    live.probed(10.5, 10.0, remaining)
    assert live.state is state
    assert live.alive_until == alive_until


def test_lease_not_found_from_etcd_is_lost() -> None:
    live = Liveness(1, 5, granted_at=0.0)
    assert live.not_found(2.0, "etcdserver: requested lease not found") == Change(LOST, 2.0)
    assert live.lost_reason == "etcd says etcdserver: requested lease not found"


def test_failed_and_closed_are_final_and_carry_their_reason() -> None:
    live = Liveness(1, 5, granted_at=0.0)
    assert live.end(FAILED, 3.0, "its keep-alive thread died") == Change(FAILED, 3.0)
    assert live.lost_reason == "its keep-alive thread died"
    assert live.not_found(4.0, "lease not found") is None and live.state is FAILED
    closed = Liveness(1, 5, granted_at=0.0)
    assert closed.end(CLOSED, 1.0, "closed") == Change(CLOSED, 1.0)
    assert closed.check(50.0) is None


def test_the_outage_names_every_endpoint_tried_and_the_last_error() -> None:
    live = Liveness(0x694D7F3A, 5, granted_at=10.0)
    live.failed("10.0.0.1:2379", "UNAVAILABLE: connection refused")
    live.failed("10.0.0.2:2379", "DEADLINE_EXCEEDED: Deadline Exceeded")
    live.failed("10.0.0.1:2379", "UNAVAILABLE: connection refused")
    outage = live.outage()
    assert outage == Outage(
        0x694D7F3A,
        10.0,
        ("10.0.0.1:2379", "10.0.0.2:2379"),
        "10.0.0.1:2379: UNAVAILABLE: connection refused",
    )
    assert outage.message(17.25) == (
        "etcd unreachable: no member answered the keep-alive of lease 694d7f3a for 7.2 s "
        "(tried 10.0.0.1:2379, 10.0.0.2:2379; last error from 10.0.0.1:2379: UNAVAILABLE: "
        "connection refused); workers keep running and keep-alives go on; the lease counts "
        "as lost only if etcd says so when it answers"
    )
    # An answer starts a new account.
    _answered_at(live, 20.0, 20.1)
    assert live.outage() == Outage(0x694D7F3A, 20.1, (), "")
    assert live.outage().message(26.0) == (
        "etcd unreachable: no member answered the keep-alive of lease 694d7f3a for 5.9 s "
        "(tried no endpoint yet); workers keep running and keep-alives go on; the lease "
        "counts as lost only if etcd says so when it answers"
    )


def _waiting(sent: float, granted_at: float = 0.0, ttl: int = 6) -> Liveness:
    live = Liveness(1, ttl, granted_at=granted_at)
    live.sent(live.new_stream(), sent)
    return live


def test_a_member_silent_since_the_keepalive_went_out_is_hung_after_an_interval() -> None:
    live = _waiting(sent=1.0)
    assert not live.member_hung(2.9, 2.0, member_heard_at=0.5)  # not a whole interval yet
    assert live.member_hung(3.0, 2.0, member_heard_at=0.5)


def test_a_member_that_answers_other_calls_is_slow_not_hung() -> None:
    # An overloaded member (a thousand nodes joining) answers late but answers: reopening
    # the stream elsewhere would only add load.
    live = _waiting(sent=1.0)
    assert not live.member_hung(3.5, 2.0, member_heard_at=1.2)


def test_a_slow_member_is_left_when_the_lease_would_run_out_within_an_interval() -> None:
    live = _waiting(sent=1.0, granted_at=0.0, ttl=6)  # alive until 6.0
    assert not live.member_hung(3.9, 2.0, member_heard_at=3.5)
    assert live.member_hung(4.1, 2.0, member_heard_at=3.5)


def test_nothing_unanswered_is_never_hung() -> None:
    live = Liveness(1, 6, granted_at=0.0)
    assert not live.member_hung(100.0, 2.0, member_heard_at=-1.0)


@pytest.mark.parametrize(
    ("attempt", "details", "ours"),
    [
        (2, "etcdserver: lease already exists", True),
        (3, "etcdserver: lease already exists", True),
        (1, "etcdserver: lease already exists", False),  # another lease has the id
        (2, "etcdserver: too many requests", False),
    ],
)
def test_a_retried_grant_answered_already_exists_is_our_lease(
    attempt: int, details: str, ours: bool
) -> None:
    assert earlier_grant_applied(attempt, details) is ours


# -- watch_probe: a watch stream's member, silent ------------------------------------------


@pytest.mark.parametrize(
    ("now", "heard", "probe_sent", "expected"),
    [
        (10.9, 10.0, None, Probe.WAIT),  # silent for less than an interval
        (11.0, 10.0, None, Probe.SEND),  # an interval: ask for progress
        (11.5, 10.0, 11.0, Probe.WAIT),  # asked; the answer may still come
        (12.0, 10.0, 11.0, Probe.HUNG),  # asked an interval ago: nothing at all
        (12.0, 11.2, 11.0, Probe.WAIT),  # answered (anything heard after the probe)
        (12.3, 11.2, 11.0, Probe.SEND),  # answered, then silent an interval again
        (50.0, 49.5, 11.0, Probe.WAIT),  # an old probe answered long ago counts for nothing
    ],
)
def test_watch_probe(now: float, heard: float, probe_sent: float | None, expected: Probe) -> None:
    assert watch_probe(now, heard, probe_sent, interval=1.0) is expected

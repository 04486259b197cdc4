"""Which etcd failures a join outlasts (coordinator/core/join_retry.py), on a fake clock:
table-driven, no etcd."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pytest

from coordinator.core.errors import (
    EtcdAuthError,
    EtcdConnectionError,
    EtcdElasticError,
    EtcdPermissionError,
    EtcdTLSError,
)
from coordinator.core.join_retry import retry_until

DEADLINE = 10.0
UNREACHABLE = EtcdConnectionError("no etcd member answered")
REFUSED = EtcdPermissionError("etcd user 'trainer' is not permitted to put on key k")
WRONG_PASSWORD = EtcdAuthError("etcd refused user 'trainer': authentication failed")
TLS = EtcdTLSError("TLS handshake refused")


class FakeTime:
    """A clock that only the retries' sleeps move."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _calls(failures: Sequence[EtcdElasticError], result: str = "ok") -> Callable[[], str]:
    """A call that fails with ``failures`` in turn, then returns ``result``."""
    left = list(failures)

    def call() -> str:
        if left:
            raise left.pop(0)
        return result

    return call


def _retry(
    call: Callable[[], str], time: FakeTime, *, permitted: bool, unreachable_too: bool = True
) -> str:
    return retry_until(
        call, DEADLINE, doing="node n: asking for round 2 of run r", permitted=lambda: permitted,
        unreachable_too=unreachable_too, clock=lambda: time.now, sleep=time.sleep,
        jitter=lambda: 0.5,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("failures", "permitted", "unreachable_too"),
    [([UNREACHABLE] * 3, False, True),  # etcd away: waited for, had the permission or not
     ([REFUSED] * 3, True, True),  # a permission this node had: waited for
     ([REFUSED] * 3, True, False),  # ... even where etcd away is not
     ([UNREACHABLE, REFUSED, UNREACHABLE], True, True)],
)  # fmt: skip
def test_what_is_waited_for_until_it_passes(
    failures: list[EtcdElasticError], permitted: bool, unreachable_too: bool
) -> None:
    time = FakeTime()
    assert _retry(_calls(failures), time, permitted=permitted, unreachable_too=unreachable_too)
    assert len(time.sleeps) == 3 and time.now < DEADLINE


@pytest.mark.parametrize(
    ("failure", "permitted", "unreachable_too"),
    [(REFUSED, False, True),  # never had it: a role without the grant, to fix, not wait out
     (WRONG_PASSWORD, True, True),  # a wrong credential does not heal by waiting
     (TLS, True, True),
     (UNREACHABLE, True, False)],  # the caller's client waited for etcd already
)  # fmt: skip
def test_what_ends_at_once(
    failure: EtcdElasticError, permitted: bool, unreachable_too: bool
) -> None:
    time = FakeTime()
    with pytest.raises(type(failure)) as info:
        _retry(_calls([failure]), time, permitted=permitted, unreachable_too=unreachable_too)
    assert info.value is failure
    assert time.sleeps == []


@pytest.mark.parametrize("failure", [UNREACHABLE, REFUSED])
def test_the_last_failure_is_raised_at_the_deadline_and_no_sleep_passes_it(
    failure: EtcdElasticError,
) -> None:
    time = FakeTime()
    with pytest.raises(type(failure)):
        _retry(_calls([failure] * 1000), time, permitted=True)
    assert time.now == pytest.approx(DEADLINE)
    assert max(time.sleeps) <= 1.0  # backoff_delay's cap: a grant back is seen within 1 s


def test_a_refusal_is_said_once_and_its_end_once(caplog: pytest.LogCaptureFixture) -> None:
    time = FakeTime()
    with caplog.at_level(logging.WARNING, logger="coordinator.core.join_retry"):
        _retry(_calls([REFUSED] * 5), time, permitted=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("node n: asking for round 2 of run r: etcd refuses it (etcd user")
    assert (
        "this node had that permission: waiting for it to be granted again, up to 10 s"
        in (lines[0])
    )
    assert lines[1] == "node n: asking for round 2 of run r: etcd permits it again"

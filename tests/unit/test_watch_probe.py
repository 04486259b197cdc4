"""Which probe a silent watch member gets (coordinator.core.etcd_client._watch_probe).

etcd answers a progress request on the watch stream; its gRPC proxy drops it. A member
not yet known either way gets both a progress request and a read; one that answered a
read but not the progress request gets reads from then on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from etcd3 import etcdrpc
from etcd3.etcdrpc import kv_pb2

from coordinator.core.etcd_client import EtcdClient, EtcdConfig
from coordinator.core.etcd_client._watch_probe import Prober, is_progress

BOTH, PROGRESS, READ = (True, True), (True, False), (False, True)


@pytest.fixture
def prober() -> Iterator[Prober]:
    with EtcdClient(
        EtcdConfig(("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
    ) as client:  # no I/O until a call
        yield Prober(client)


def test_an_unknown_member_gets_both_until_it_answers_a_progress_request(prober: Prober) -> None:
    assert prober.kinds(0, last_probe_unanswered=False) == BOTH
    prober.heard(0, etcdrpc.WatchResponse(watch_id=-1))  # etcd's answer to progress
    assert prober.kinds(0, last_probe_unanswered=True) == PROGRESS
    assert prober.kinds(1, last_probe_unanswered=False) == BOTH  # per member


def test_a_member_heard_but_silent_to_progress_gets_reads_from_then_on(prober: Prober) -> None:
    assert prober.kinds(2, last_probe_unanswered=False) == BOTH
    prober.heard(2, etcdrpc.WatchResponse(watch_id=3, created=True))  # not a progress answer
    assert prober.kinds(2, last_probe_unanswered=True) == READ
    assert prober.kinds(2, last_probe_unanswered=False) == READ


@pytest.mark.parametrize(
    ("response", "progress"),
    [
        (etcdrpc.WatchResponse(watch_id=-1), True),
        (etcdrpc.WatchResponse(watch_id=0, created=True), False),
        (etcdrpc.WatchResponse(watch_id=-1, created=True, canceled=True), False),  # refused
        (etcdrpc.WatchResponse(watch_id=4, events=[kv_pb2.Event()]), False),
    ],
)
def test_is_progress(response: object, progress: bool) -> None:
    assert is_progress(response) is progress

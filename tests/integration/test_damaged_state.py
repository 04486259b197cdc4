"""A damaged state key on real etcd: unreadable, out of range, or deleted.

What must hold (DESIGN §6, §9; issue 8 item 7): a running attempt keeps training while
the state is unreadable (the view answers from the last good state), the error naming the
key is logged once, a NEW rendezvous fails at once with one line, the coordinator neither
crash-loops nor overwrites the value and resumes when a valid value appears, and a
deleted state is written back so the rounds continue from the last one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from coordinator.core.duty import CoordinatorDuty, Membership
from coordinator.core.errors import CorruptValueError
from coordinator.core.etcd_client import EtcdClient, EtcdConfig, WatchEvent
from coordinator.core.state import RdzvState, decode_state, encode_state
from coordinator.core.transitions import Limits
from coordinator.core.view import StateView
from coordinator.etcd_server import EtcdCluster
from coordinator.torch_adapter.handler import EtcdRendezvousHandler
from tests.integration.coordinator_support import Run, run_fixture  # noqa: F401 (fixture)
from tests.rdzv_helpers import Joins, make_handler, shutdown_all, wait_until

pytestmark = pytest.mark.integration

ROUND_3 = RdzvState(round=3, participants=("node-a", "node-b"), master_addr="node-a")
GARBAGE = [b'{"schema_version": 1, "round": "x"}', b"\x80\x03not json", b"{}"]


@pytest.fixture
def view(etcd1: EtcdCluster, run: Run) -> Iterator[StateView]:
    client = EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints)))
    made = StateView(client, run.keys.state)
    try:
        yield made
    finally:
        made.close()
        client.close()


def _put(run: Run, value: bytes) -> int:
    return run.client.put(run.keys.state, value)


def _reaches(view: StateView, revision: int) -> None:
    assert view.wait_newer(revision - 1, 10), f"the view never reached revision {revision}"


def _records(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]


# -- the view ---------------------------------------------------------------------------------


def test_view_keeps_the_last_good_state_while_unreadable_and_logs_once(
    view: StateView, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.core.view")
    key = run.keys.state.decode()
    _put(run, encode_state(ROUND_3))
    view.start()
    for value in GARBAGE:  # an operator trying several values by hand
        last = _put(run, value)
    _reaches(view, last)

    error = view.error
    assert isinstance(error, CorruptValueError) and error.key == key
    assert (
        str(error)
        == f"corrupt value at etcd key {key!r}: no schema_version: not written by etcd-elastic"
    )
    assert view.peek() == ROUND_3  # what a running attempt asks keeps answering
    with pytest.raises(CorruptValueError) as raised:
        view.snapshot()  # what a new rendezvous asks fails at once
    assert raised.value is error
    with pytest.raises(CorruptValueError):
        view.read()
    logged = _records(caplog, logging.ERROR, key)
    assert len(logged) == 1, logged  # once, not once per value
    assert logged[0].endswith(
        "; keeping the last good state (round 3): running workers go on, a new rendezvous "
        "fails until a valid value is written"
    )

    fixed = _put(run, encode_state(RdzvState(round=4, participants=("node-a",))))
    _reaches(view, fixed)
    assert view.error is None and view.snapshot() == (view.peek(), fixed)
    assert view.peek().round == 4
    assert _records(caplog, logging.INFO, "is readable again") == [
        f"state key {key} is readable again"
    ]


def test_view_keeps_the_last_state_when_the_key_is_deleted(
    view: StateView, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.core.view")
    _put(run, encode_state(ROUND_3))
    view.start()
    _, deleted_at = run.client.delete(run.keys.state)
    _reaches(view, deleted_at)
    # Absent (mod_revision 0), but still round 3: nothing decides "round 1" from it.
    assert view.snapshot() == (ROUND_3, 0) and view.error is None
    assert _records(caplog, logging.WARNING, "was deleted") == [
        f"state key {run.keys.state.decode()} was deleted; keeping its last state (round 3) "
        "for the coordinator to write back"
    ]


# -- the coordinator duty -----------------------------------------------------------------------


def _duty(run: Run, view: StateView, me: Membership, limits: Limits) -> CoordinatorDuty:
    client = view._client  # the view's own client: the duty shares it, as in the handler
    return CoordinatorDuty(client, run.keys, view, limits, lambda: me)


def test_duty_waits_on_an_unreadable_state_and_resumes_on_a_valid_one(
    view: StateView, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="coordinator.core.duty")
    a = run.node("node-a").join(1)
    view.start()
    duty = _duty(run, view, a, Limits(1, 1, 30.0))
    try:
        duty.start()
        wait_until(lambda: (run.state()[0] or RdzvState()).round == 1, 30, "round 1")
        good, _ = run.client.get(run.keys.state)
        assert good is not None
        _reaches(view, _put(run, GARBAGE[2]))
        wait_until(lambda: bool(_records(caplog, logging.ERROR, "not coordinating")), 10, "pause")
        # Events keep coming meanwhile: a node joins, the operator tries another value.
        run.node("node-b").join(2)
        _reaches(view, _put(run, GARBAGE[1]))
        assert run.client.get(run.keys.state)[0].value == GARBAGE[1]  # type: ignore[union-attr]
        assert duty.commits == 1 and duty.is_leader

        _put(run, good.value)  # a valid value again: the duty carries on (b is a spare)
        wait_until(
            lambda: (run.state()[0] or RdzvState()).redundancy_list == ("node-b",), 30, "resume"
        )
    finally:
        duty.stop()
    assert _records(caplog, logging.ERROR, "not coordinating") == [
        f"run {run.keys.run_id}: not coordinating while the state key is unreadable "
        "(no schema_version: not written by etcd-elastic)"
    ]
    assert len(_records(caplog, logging.INFO, "coordinates run")) == 1  # never re-elected
    assert _records(caplog, logging.INFO, "is readable again") == [
        f"run {run.keys.run_id}: the state key is readable again"
    ]


def test_duty_writes_back_a_deleted_state_and_the_rounds_go_on(
    view: StateView, run: Run, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.core.duty")
    a, b = run.node("node-a"), run.node("node-b")
    me = a.join(1)
    b.join(1)
    view.start()
    duty = _duty(run, view, me, Limits(2, 2, 30.0))
    try:
        duty.start()
        wait_until(lambda: (run.state()[0] or RdzvState()).round == 1, 30, "round 1")
        a.put(2)
        b.put(2)
        wait_until(lambda: (run.state()[0] or RdzvState()).round == 2, 30, "round 2")
        formed, _ = run.state()
        assert formed is not None
        run.client.delete(run.keys.state)
        wait_until(lambda: run.state()[0] is not None, 30, "the state written back")
        back, _ = run.state()
        assert back is not None and back.written_by == "node-a"
        assert (back.round, back.participants) == (2, formed.participants)
        a.put(3)
        b.put(3)
        wait_until(lambda: (run.state()[0] or RdzvState()).round == 3, 30, "round 3")
    finally:
        duty.stop()
    assert _records(caplog, logging.WARNING, "was gone") == [
        f"run {run.keys.run_id}: the state key was gone; wrote back round 2"
    ]


def test_a_coordinator_that_never_saw_the_state_continues_from_the_store(
    view: StateView, run: Run
) -> None:
    """The state key is gone and this coordinator's view never saw it: the highest round
    with store keys (5, here only its exactly-once markers) is where the run goes on."""
    run.client.put(run.keys.store_key(4, "rank0"), b"host-a")
    run.client.put(run.keys.store_root + b"5~ops/0123", b"1")
    a, b = run.node("node-a"), run.node("node-b")
    me = a.join(1)  # what a node asks for when it sees no state
    b.join(1)
    rounds: list[int] = []

    def on_events(events: list[WatchEvent], _revision: int) -> None:
        key = run.keys.state.decode()
        rounds.extend(decode_state(key, e.kv.value).round for e in events if e.kind == "put")

    watch = run.client.watch(run.keys.state, 0, on_events, lambda _rev: None)
    watch.wait_created()
    view.start()
    duty = _duty(run, view, me, Limits(2, 2, 30.0))
    try:
        duty.start()
        wait_until(lambda: run.state()[0] is not None, 30, "the state written back")
        a.put(6)
        b.put(6)
        wait_until(lambda: (run.state()[0] or RdzvState()).round == 6, 30, "round 6")
        wait_until(lambda: 6 in rounds, 30, "the watch to deliver round 6")
    finally:
        duty.stop()
        watch.cancel()
    # Written back at round 5, then only rounds 5 (the wait list) and 6: never "round 1"
    # over old store keys.
    assert rounds[0] == 5 and set(rounds) == {5, 6}, rounds


# -- through the handler ---------------------------------------------------------------------


def test_a_new_rendezvous_fails_at_once_while_running_nodes_keep_answering(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    handlers += [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    Joins(handlers).start().infos()
    key = f"/etcd-elastic/{run_id}/state"
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        client.put(key.encode(), GARBAGE[2])
    newcomer = make_handler(etcd1, run_id, 2, 2)
    handlers.append(newcomer)
    with pytest.raises(RendezvousStateError) as err:
        newcomer.next_rendezvous()
    assert str(err.value) == (
        f"corrupt value at etcd key {key!r}: no schema_version: not written by etcd-elastic"
    )
    assert [h.num_nodes_waiting() for h in handlers[:2]] == [0, 0]  # they train on


def test_a_round_at_the_int64_limit_is_a_one_line_error(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    key = f"/etcd-elastic/{run_id}/state"
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        client.put(key.encode(), b'{"schema_version": 1, "round": "9223372036854775807"}')
    handlers.append(make_handler(etcd1, run_id, 1, 1))
    with pytest.raises(RendezvousStateError) as err:
        handlers[0].next_rendezvous()
    assert str(err.value) == (
        f"corrupt value at etcd key {key!r}: round 9223372036854775807 is out of range: "
        "the next round would not fit int64"
    )


def test_nodes_that_join_after_a_deleted_state_continue_from_the_last_round(
    etcd1: EtcdCluster, run_id: str, handlers: list[EtcdRendezvousHandler]
) -> None:
    first = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
    handlers += first
    for _ in range(2):
        Joins(first).start().infos()[0].store.set("k", "v")  # rounds 1 and 2
    shutdown_all(first)  # they leave (the run stays open)
    state_key = f"/etcd-elastic/{run_id}/state".encode()
    with EtcdClient(EtcdConfig(endpoints=tuple(etcd1.endpoints))) as client:
        client.delete(state_key)
        later = [make_handler(etcd1, run_id, 2, 2) for _ in range(2)]
        handlers += later
        infos = Joins(later).start().infos()
        kv, _ = client.get(state_key)
    assert sorted(i.rank for i in infos.values()) == [0, 1]
    assert kv is not None and b'"round":"3"' in kv.value
    assert infos[0].store.prefix.endswith(b"/store/3/")  # type: ignore[attr-defined]

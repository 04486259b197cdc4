"""The stored form of the state and node records: round trips, readability, refusals, size."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.actions import Action, ActionKind, apply
from coordinator.core.errors import CorruptValueError
from coordinator.core.restart_budget import RestartCount
from coordinator.core.state import (
    MAX_ROUND,
    SCHEMA_VERSION,
    NodeInfo,
    RdzvState,
    decode_node,
    decode_state,
    encode_node,
    encode_state,
)
from coordinator.core.transitions import workers_of

KEY = "/etcd-elastic/job42/state"
NODE_KEY = "/etcd-elastic/job42/nodes/host-a-100-0"
# etcd's default --max-request-bytes; the state is written in one put inside a txn.
ETCD_MAX_REQUEST = int(1.5 * 1024 * 1024)

_FULL_STATE = RdzvState(
    round=7,
    closed=True,
    participants=("host-a-100-0", "host-b-200-0", "hôst-ü-300-1"),
    wait_list=("host-c-300-0",),
    redundancy_list=("host-d-400-0", "host-e-500-0"),
    lost=("host-b-200-0",),
    closed_reason="training finished",
    master_addr="10.0.0.1",
    master_port=29500,
    completed_at_unix_ms=1_700_000_000_123,
    written_by="host-a-100-0",
    workers=(("trainer", 8), ("ps", 1), ("trainer", 8)),
    restarts=RestartCount(used=2, round=6, refunded=True),
)

_FULL_NODE = NodeInfo(
    node_id="host-a-100-0",
    wanted_round=8,
    addr="10.0.0.1",
    hostname="host-a",
    pid=100,
    local_world_size=8,
    role="trainer",
    lease_id=0x7FFF_FFFF_FFFF_FFFF,
    started_at_unix_ms=1_700_000_000_000,
    free_port=29500,
    create_revision=42,
)


@pytest.mark.parametrize(
    "state",
    [
        RdzvState(),
        RdzvState(round=1, participants=("a",)),
        RdzvState(closed=True, closed_reason="closed before any round formed"),
        _FULL_STATE,
    ],
    ids=["empty", "one participant", "closed at round 0", "every field"],
)
def test_state_round_trip(state: RdzvState) -> None:
    assert decode_state(KEY, encode_state(state)) == state


@pytest.mark.parametrize(
    "node",
    [NodeInfo("n", 1), _FULL_NODE],
    ids=["minimal", "every field"],
)
def test_node_round_trip(node: NodeInfo) -> None:
    decoded = decode_node(NODE_KEY, encode_node(node), create_revision=42)
    assert decoded == node
    # The create revision is etcd's, not part of the value: it comes from the caller.
    assert decoded.create_revision == 42
    assert decode_node(NODE_KEY, encode_node(node)).create_revision == 0


def test_zero_values_are_written() -> None:
    doc = json.loads(encode_state(RdzvState()).decode("utf-8"))
    assert doc["closed"] is False and doc["round"] == "0" and doc["wait_list"] == []
    assert doc["close_mode"] == "CLOSE_MODE_UNSPECIFIED"


def test_encoded_state_is_readable_json_with_field_names() -> None:
    raw = encode_state(_FULL_STATE)
    doc = json.loads(raw.decode("utf-8"))
    assert doc["schema_version"] == SCHEMA_VERSION == 4
    assert doc["incarnation"] == "1"
    # protobuf's JSON mapping writes int64 as a string; zero values are written too
    # (rank 0, "closed": false), so an operator reading etcdctl output sees every field.
    assert doc["round"] == "7"
    assert doc["complete"] is True
    assert doc["closed"] is True
    assert doc["participants"] == [
        {"node_id": "host-a-100-0", "rank": 0},
        {"node_id": "host-b-200-0", "rank": 1},
        {"node_id": "hôst-ü-300-1", "rank": 2},
    ]
    assert doc["wait_list"] == ["host-c-300-0"]
    assert doc["redundancy_list"] == ["host-d-400-0", "host-e-500-0"]
    assert doc["lost"] == ["host-b-200-0"]
    assert doc["closed_reason"] == "training finished"
    assert doc["master_addr"] == "10.0.0.1"
    assert doc["master_port"] == 29500
    assert doc["written_by"] == "host-a-100-0"
    assert doc["worker_kinds"] == [
        {"role": "trainer", "local_world_size": 8},
        {"role": "ps", "local_world_size": 1},
    ]
    assert doc["worker_kind_of"] == [0, 1, 0]
    assert doc["restarts"] == {"used": "2", "round": "6", "refunded": True}
    assert b"\n" not in raw  # one line in `etcdctl get` output


def test_workers_that_are_all_alike_are_one_kind_and_no_index() -> None:
    state = RdzvState(round=1, participants=("a", "b", "c"), workers=(("t", 4),) * 3)
    doc = json.loads(encode_state(state).decode("utf-8"))
    assert doc["worker_kinds"] == [{"role": "t", "local_world_size": 4}]
    assert doc["worker_kind_of"] == []
    assert decode_state(KEY, encode_state(state)) == state


@pytest.mark.parametrize(
    ("workers", "stored"),
    [
        ((("t", 1), ("t", 0)), False),  # a record without its local world size
        ((("", 1),), False),  # without its role
        ((("r" * 129, 1),), False),
        (tuple(("t", n) for n in range(1, 66)), False),  # 65 kinds
        (tuple(("t", n) for n in range(1, 65)), True),  # 64 kinds
    ],
    ids=["size 0", "no role", "role too long", "65 kinds", "64 kinds"],
)
def test_workers_the_state_cannot_hold_are_left_out_by_the_coordinator(
    workers: tuple[tuple[str, int], ...], stored: bool
) -> None:
    nodes = [
        NodeInfo(f"n{i}", 1, role=role, local_world_size=size)
        for i, (role, size) in enumerate(workers)
    ]
    chosen = workers_of(nodes)
    assert chosen == (workers if stored else ())
    state = RdzvState(round=1, participants=tuple(n.node_id for n in nodes), workers=chosen)
    assert decode_state(KEY, encode_state(state)) == state


def test_encoded_node_is_readable_json_with_field_names() -> None:
    doc = json.loads(encode_node(_FULL_NODE).decode("utf-8"))
    assert doc == {
        "schema_version": 4,
        "node_id": "host-a-100-0",
        "addr": "10.0.0.1",
        "hostname": "host-a",
        "pid": 100,
        "local_world_size": 8,
        "role": "trainer",
        "wanted_round": "8",
        "lease_id": str(0x7FFF_FFFF_FFFF_FFFF),
        "started_at_unix_ms": "1700000000000",
        "free_port": 29500,
        "incarnation": "1",
    }


def test_values_of_schema_version_1_are_incarnation_1() -> None:
    """Written before incarnations existed: no field, read as the first incarnation."""
    state = decode_state(KEY, _json({"schema_version": 1, "round": "3", "closed": True}))
    assert (state.round, state.closed, state.incarnation) == (3, True, 1)
    node = decode_node(NODE_KEY, _json({"schema_version": 1, "node_id": "a", "wanted_round": "4"}))
    assert node.incarnation == 1
    again = RdzvState(round=3, incarnation=7)
    assert decode_state(KEY, encode_state(again)).incarnation == 7


def test_values_before_schema_version_4_count_no_restart() -> None:
    """Written before the job's restart budget: nothing counted; always written since."""
    old = {"schema_version": 3, "round": "3", "participants": [{"node_id": "a"}]}
    assert decode_state(KEY, _json(old)).restarts == RestartCount()
    doc = json.loads(encode_state(RdzvState()).decode("utf-8"))
    assert doc["restarts"] == {"used": "0", "round": "0", "refunded": False}


# --- refusals ----------------------------------------------------------------------------

_TRIPWIRE: list[str] = []


def _tripwire(what: str) -> str:
    _TRIPWIRE.append(what)
    return what


class _Payload:
    """Unpickling this calls _tripwire: proof that a decoder did (or did not) run pickle."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_tripwire, ("unpickled",))


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode()


_NOT_JSON = "not a RendezvousState in JSON ("

STATE_REFUSALS: list[tuple[str, bytes, str]] = [
    # (id, raw value, expected text of the reason, as a prefix)
    ("not UTF-8", b'{"schema_version": 1, "written_by": "\xff"}',
     _NOT_JSON + "'utf-8' codec can't decode byte 0xff"),
    ("empty", b"", _NOT_JSON + "Failed to load JSON"),
    ("not JSON", b"round=3;participants=a,b", _NOT_JSON + "Failed to load JSON"),
    ("truncated JSON", encode_state(_FULL_STATE)[:40], _NOT_JSON + "Failed to load JSON"),
    ("JSON list", b"[1, 2]", _NOT_JSON),
    ("JSON null", b"null", _NOT_JSON),
    ("JSON number", b"3", _NOT_JSON),
    ("a node record", encode_node(_FULL_NODE),
     _NOT_JSON + 'Message type "etcd_elastic.v1.RendezvousState" has no field named "node_id"'),
    ("unknown field", _json({"schema_version": 1, "leader": "x"}),
     _NOT_JSON + 'Message type "etcd_elastic.v1.RendezvousState" has no field named "leader"'),
    ("wrong field type", _json({"schema_version": 1, "participants": {"a": 0}}),
     _NOT_JSON + "Failed to parse participants field"),
    ("round out of range", b'{"schema_version": 1, "round": 1e30}',
     _NOT_JSON + "Failed to parse round field"),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, _NOT_JSON + "Failed to load JSON"),
    ("pickle protocol 0 (ASCII)", pickle.dumps(_Payload(), protocol=0),
     _NOT_JSON + "Failed to load JSON"),
    ("pickle highest protocol", pickle.dumps(_Payload(), protocol=pickle.HIGHEST_PROTOCOL),
     _NOT_JSON + "'utf-8' codec can't decode byte 0x80"),
    ("no schema_version", _json({"round": "3"}),
     "no schema_version: not written by etcd-elastic"),
    ("schema_version 0", _json({"schema_version": 0, "round": "3"}),
     "no schema_version: not written by etcd-elastic"),
    ("newer schema_version", _json({"schema_version": 5, "round": "3"}),
     "schema_version 5 is newer than this etcd-elastic understands (4); "
     "upgrade every agent of the run"),
    ("negative restarts used", _json({"schema_version": 4, "round": "3",
     "restarts": {"used": "-1", "round": "2"}}),
     "restarts: -1 used, last counted in round 2: not a count of rounds 0..3"),
    ("restarts counted in a round not reached", _json({"schema_version": 4, "round": "3",
     "restarts": {"used": "1", "round": "4"}}),
     "restarts: 1 used, last counted in round 4: not a count of rounds 0..3"),
    ("ranks not from 0", _json({"schema_version": 1, "round": "1",
     "participants": [{"node_id": "a", "rank": 1}, {"node_id": "b", "rank": 2}]}),
     "participant ranks [1, 2] are not 0..1"),
    ("ranks out of order", _json({"schema_version": 1, "round": "1",
     "participants": [{"node_id": "a", "rank": 1}, {"node_id": "b"}]}),
     "participant ranks [1, 0] are not 0..1"),
    ("rank repeated", _json({"schema_version": 1, "round": "1",
     "participants": [{"node_id": "a"}, {"node_id": "b"}]}),
     "participant ranks [0, 0] are not 0..1"),
    ("negative round", _json({"schema_version": 1, "round": "-1"}), "negative round -1"),
    ("negative incarnation", _json({"schema_version": 2, "incarnation": "-1"}),
     "negative incarnation -1"),
    ("round at the int64 limit", _json({"schema_version": 1, "round": str(2**63 - 1)}),
     "round 9223372036854775807 is out of range: the next round would not fit int64"),
    ("master_port above 65535", _json({"schema_version": 1, "master_port": 70000}),
     "master_port 70000 is not a TCP port (1..65535)"),
    ("negative master_port", _json({"schema_version": 1, "master_port": -1}),
     "master_port -1 is not a TCP port (1..65535)"),
    ("worker index without kinds", _json({"schema_version": 3, "round": "1",
     "participants": [{"node_id": "a"}], "worker_kind_of": [0]}),
     "worker_kind_of without worker_kinds"),
    ("worker index out of range", _json({"schema_version": 3, "round": "1",
     "participants": [{"node_id": "a"}, {"node_id": "b", "rank": 1}],
     "worker_kinds": [{"role": "t", "local_world_size": 1},
                      {"role": "u", "local_world_size": 1}], "worker_kind_of": [0, 2]}),
     "worker_kind_of has 2 entries for 2 participants and 2 worker kinds"),
    ("worker index too short", _json({"schema_version": 3, "round": "1",
     "participants": [{"node_id": "a"}, {"node_id": "b", "rank": 1}],
     "worker_kinds": [{"role": "t", "local_world_size": 1},
                      {"role": "u", "local_world_size": 1}], "worker_kind_of": [0]}),
     "worker_kind_of has 1 entries for 2 participants"),
    ("worker kind of size 0", _json({"schema_version": 3, "round": "1",
     "participants": [{"node_id": "a"}], "worker_kinds": [{"role": "t"}]}),
     "worker_kinds [('t', 0)]... are not what a node runs"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "reason"), [c[1:] for c in STATE_REFUSALS], ids=[c[0] for c in STATE_REFUSALS]
)
def test_decode_state_refuses(raw: bytes, reason: str) -> None:
    _TRIPWIRE.clear()
    with pytest.raises(CorruptValueError) as info:
        decode_state(KEY, raw)
    assert info.value.key == KEY
    assert info.value.reason.startswith(reason), info.value.reason
    assert str(info.value) == f"corrupt value at etcd key {KEY!r}: {info.value.reason}"
    assert _TRIPWIRE == []  # nothing in the value was executed


def test_pickle_payload_is_live_but_never_loaded() -> None:
    """The pickle cases above would run code if unpickled; the decoders only refuse them."""
    for protocol in (0, pickle.HIGHEST_PROTOCOL):
        payload = pickle.dumps(_Payload(), protocol=protocol)
        _TRIPWIRE.clear()
        assert pickle.loads(payload) == "unpickled"  # the payload really is live
        assert _TRIPWIRE == ["unpickled"]
        _TRIPWIRE.clear()
        for decode, key in ((decode_state, KEY), (decode_node, NODE_KEY)):
            with pytest.raises(CorruptValueError, match="in JSON"):
                decode(key, payload)
        assert _TRIPWIRE == []


_DUPLICATE = _json(
    {
        "schema_version": 1,
        "round": "1",
        "participants": [{"node_id": "host-a-100-0"}, {"node_id": "host-a-100-0", "rank": 1}],
    }
)


def test_duplicate_participant_is_refused() -> None:
    with pytest.raises(CorruptValueError, match="twice among the participants") as info:
        decode_state(KEY, _DUPLICATE)
    assert info.value.key == KEY


def test_duplicate_participant_message_names_the_node() -> None:
    with pytest.raises(CorruptValueError) as info:
        decode_state(KEY, _DUPLICATE)
    assert "'host-a-100-0'" in info.value.reason


NODE_REFUSALS: list[tuple[str, bytes, str]] = [
    ("not UTF-8", b"\xfe\xff", "not a NodeRecord in JSON ('utf-8' codec can't decode"),
    ("not JSON", b"host-a 10.0.0.1", "not a NodeRecord in JSON (Failed to load JSON"),
    ("a state value", encode_state(_FULL_STATE),
     'not a NodeRecord in JSON (Message type "etcd_elastic.v1.NodeRecord" has no field named'),
    ("no schema_version", _json({"node_id": "a", "wanted_round": "1"}),
     "no schema_version: not written by etcd-elastic"),
    ("newer schema_version", _json({"schema_version": 9, "node_id": "a"}),
     "schema_version 9 is newer than this etcd-elastic understands (4); "
     "upgrade every agent of the run"),
    ("negative wanted_round", _json({"schema_version": 1, "wanted_round": "-2"}),
     "negative wanted_round -2"),
    ("free_port above 65535", _json({"schema_version": 1, "free_port": 65536}),
     "free_port 65536 is not a TCP port (1..65535)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("raw", "reason"), [c[1:] for c in NODE_REFUSALS], ids=[c[0] for c in NODE_REFUSALS]
)
def test_decode_node_refuses(raw: bytes, reason: str) -> None:
    with pytest.raises(CorruptValueError) as info:
        decode_node(NODE_KEY, raw)
    assert info.value.key == NODE_KEY
    assert info.value.reason.startswith(reason), info.value.reason
    assert NODE_KEY in str(info.value)


# --- size ------------------------------------------------------------------------------


def _node_ids(count: int, host: str = "host-name") -> tuple[str, ...]:
    # <host>-<pid>-<counter>, as coordinator.core.keys.make_node_id builds them.
    return tuple(f"{host}-{i % 1000:03d}-{10_000 + i}-0" for i in range(count))


@pytest.mark.parametrize(
    ("waiting", "spares", "lost"),
    [(0, 0, 0), (10_000, 1_000, 1_000), (10_000, 10_000, 10_000)],
    ids=["participants only", "all re-joined, 1000 spares, 1000 lost", "every list 10000 long"],
)
def test_state_of_10000_nodes_fits_one_etcd_request(waiting: int, spares: int, lost: int) -> None:
    ids = _node_ids(10_000)
    state = RdzvState(
        round=123_456,
        participants=ids,
        wait_list=ids[:waiting],  # participants asking again are listed as waiting
        redundancy_list=_node_ids(spares, host="spare-name"),
        lost=ids[-lost:] if lost else (),
        master_addr="host-name-000.cluster.local",
        master_port=29500,
        completed_at_unix_ms=1_700_000_000_000,
        written_by=ids[0],
        # The most the state holds of what each node runs: 64 kinds, neighbours differ.
        workers=tuple((f"role-{'x' * 120}-{i % 8}", 1 + i % 64) for i in range(10_000)),
    )
    raw = encode_state(state)
    print(
        f"encoded state: 10000 participants (64 worker kinds), {waiting} waiting, {spares} "
        f"spares, {lost} lost: "
        f"{len(raw)} bytes ({len(raw) / ETCD_MAX_REQUEST:.0%} of etcd's 1.5 MiB request limit)"
    )
    # Keep room for the key, the compare and the transaction framing.
    assert len(raw) < ETCD_MAX_REQUEST - 4096
    assert decode_state(KEY, raw) == state


# --- out-of-range values: refused at decode, never a crash of the encoder later -----------

_INT64 = st.integers(-(2**63), 2**63 - 1)
_INT32 = st.integers(-(2**31), 2**31 - 1)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    round_=_INT64,
    master_port=_INT32,
    completed=_INT64,
    closed_at=_INT64,
    wanted=_INT64,
    free_port=_INT32,
    lease_id=_INT64,
)
def test_whatever_decodes_re_encodes_and_so_does_the_next_round(
    round_: int,
    master_port: int,
    completed: int,
    closed_at: int,
    wanted: int,
    free_port: int,
    lease_id: int,
) -> None:
    """Any value of the schema's integer types: refused at decode with a one-line error, or
    decoded into something this project can write back, one round on included (what a
    coordinator and a joining node write next)."""
    raw_state = _json(
        {
            "schema_version": 1,
            "round": str(round_),
            "master_port": master_port,
            "completed_at_unix_ms": str(completed),
            "closed_at_unix_ms": str(closed_at),
            "participants": [{"node_id": "a"}],
        }
    )
    try:
        state = decode_state(KEY, raw_state)
    except CorruptValueError as exc:
        assert "\n" not in str(exc) and KEY in str(exc)
        assert round_ > MAX_ROUND or round_ < 0 or not 0 <= master_port <= 65535
    else:
        assert decode_state(KEY, encode_state(state)) == state
        complete = Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, node_ids=("a",), master_port=1)
        encode_state(apply(state, [complete]))  # the next round fits int64
        encode_node(NodeInfo("a", wanted_round=state.round + 1))  # and so does asking for it
    raw_node = _json(
        {
            "schema_version": 1,
            "node_id": "a",
            "wanted_round": str(wanted),
            "free_port": free_port,
            "lease_id": str(lease_id),
        }
    )
    try:
        node = decode_node(NODE_KEY, raw_node)
    except CorruptValueError as exc:
        assert "\n" not in str(exc) and NODE_KEY in str(exc)
        assert wanted < 0 or not 0 <= free_port <= 65535
    else:
        assert decode_node(NODE_KEY, encode_node(node)) == node


def test_the_highest_round_still_completes_and_the_one_after_is_refused() -> None:
    top = decode_state(KEY, _json({"schema_version": 1, "round": str(MAX_ROUND)}))
    complete = Action(ActionKind.MARK_RENDEZVOUS_COMPLETE, node_ids=("a",))
    raw = encode_state(apply(top, [complete]))  # no "ValueError: Value out of range"
    with pytest.raises(CorruptValueError) as info:
        decode_state(KEY, raw)
    assert str(info.value) == (
        f"corrupt value at etcd key {KEY!r}: round 9223372036854775807 is out of range: "
        "the next round would not fit int64"
    )

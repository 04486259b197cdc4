"""Key layout, run-id validation and Store-key encoding (pure; no server)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.core.errors import ConfigError, CorruptValueError
from coordinator.core.keys import (
    DEFAULT_KEY_PREFIX,
    RunKeys,
    decode_store_key,
    encode_store_key,
    join_store_key,
    make_node_id,
    validate_key_prefix,
    validate_node_id,
    validate_run_id,
)

_RULE = "use 1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit"


@pytest.mark.parametrize("run_id", ["a", "job42", "J.o_b-1", "0", "x" * 128, "a..b"])
def test_valid_run_ids_pass_through(run_id: str) -> None:
    assert validate_run_id(run_id) == run_id


@pytest.mark.parametrize(
    "run_id",
    ["", "job/x", "x" * 129, ".hidden", "-x", "_x", "a b", "é", "a\nb", "a*", "a%2F"],
)
def test_invalid_run_ids_name_value_and_rule(run_id: str) -> None:
    with pytest.raises(ConfigError) as exc:
        validate_run_id(run_id)
    assert str(exc.value) == f"rdzv_id {run_id!r} is invalid: {_RULE}"


def test_run_id_message_example() -> None:
    with pytest.raises(ConfigError, match=r"^rdzv_id 'job/x' is invalid: use 1-128 "):
        validate_run_id("job/x")


@pytest.mark.parametrize("prefix", ["/etcd-elastic", "/a", "/a/b.c/d_e", "/..x", "/a/..b"])
def test_valid_key_prefixes(prefix: str) -> None:
    assert validate_key_prefix(prefix) == prefix


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("etcd", "rdzv_conf key_prefix='etcd' is invalid: it must start with '/'"),
        ("", "rdzv_conf key_prefix='' is invalid: it must start with '/'"),
        ("/", "rdzv_conf key_prefix='/' is invalid: it must not end with '/'"),
        ("/a/", "rdzv_conf key_prefix='/a/' is invalid: it must not end with '/'"),
        ("/a//b", "rdzv_conf key_prefix='/a//b' is invalid: it has an empty segment ('//')"),
        (
            "/a/../b",
            "rdzv_conf key_prefix='/a/../b' is invalid: segment '..' must use characters "
            "from A-Z a-z 0-9 . _ - and not be '.' or '..'",
        ),
        (
            "/a/./b",
            "rdzv_conf key_prefix='/a/./b' is invalid: segment '.' must use characters "
            "from A-Z a-z 0-9 . _ - and not be '.' or '..'",
        ),
        (
            "/a b",
            "rdzv_conf key_prefix='/a b' is invalid: segment 'a b' must use characters "
            "from A-Z a-z 0-9 . _ - and not be '.' or '..'",
        ),
        (
            "/" + "x" * 256,
            f"rdzv_conf key_prefix='/{'x' * 256}' is invalid: it is longer than 256 characters",
        ),
    ],
)
def test_invalid_key_prefixes(prefix: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        validate_key_prefix(prefix)
    assert str(exc.value) == message


def test_default_prefix_is_valid() -> None:
    assert validate_key_prefix(DEFAULT_KEY_PREFIX) == "/etcd-elastic"


@pytest.mark.parametrize(
    ("host", "pid", "counter", "expected"),
    [
        ("host1", 42, 0, "host1-42-0"),
        ("node.example.com", 7, 3, "node.example.com-7-3"),
        ("bad host/ä", 1, 2, "bad-host---1-2"),
        ("", 1, 2, "node-1-2"),
        ("--x", 1, 2, "x-1-2"),
        ("/", 5, 6, "node-5-6"),
        ("h" * 300, 4194304, 99, "h" * 80 + "-4194304-99"),
    ],
)
def test_make_node_id_sanitizes_host(host: str, pid: int, counter: int, expected: str) -> None:
    node_id = make_node_id(host, pid, counter)
    assert node_id == expected
    assert validate_node_id(node_id) == node_id


def test_make_node_id_rejects_negative_numbers() -> None:
    with pytest.raises(ValueError, match=r"^pid -1 and counter 0 must not be negative$"):
        make_node_id("h", -1, 0)


def test_invalid_node_id_message() -> None:
    with pytest.raises(ConfigError) as exc:
        validate_node_id("a/b")
    assert str(exc.value) == f"node id 'a/b' is invalid: {_RULE}"


def test_run_keys_layout() -> None:
    keys = RunKeys("/etcd-elastic", "job42")
    assert keys.run_prefix == b"/etcd-elastic/job42/"
    assert keys.state == b"/etcd-elastic/job42/state"
    assert keys.nodes_prefix == b"/etcd-elastic/job42/nodes/"
    assert keys.node("h-1-0") == b"/etcd-elastic/job42/nodes/h-1-0"
    assert keys.store_root == b"/etcd-elastic/job42/store/"
    assert keys.store_prefix(0) == b"/etcd-elastic/job42/store/0/"
    assert keys.store_prefix(12) == b"/etcd-elastic/job42/store/12/"
    assert keys.store_key(3, "rank_0") == b"/etcd-elastic/job42/store/3/rank_0"
    assert keys.store_key(3, "a/b") == b"/etcd-elastic/job42/store/3/a%2Fb"


def test_run_keys_validate_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"^rdzv_id 'job/x' is invalid"):
        RunKeys("/etcd-elastic", "job/x")
    with pytest.raises(ConfigError, match=r"^rdzv_conf key_prefix='x' is invalid"):
        RunKeys("x", "job")


def test_one_run_prefix_never_contains_another() -> None:
    a = RunKeys("/p", "job")
    b = RunKeys("/p", "job2")
    assert not b.run_prefix.startswith(a.run_prefix)
    assert not a.run_prefix.startswith(b.run_prefix)


def test_node_id_round_trips_through_key() -> None:
    keys = RunKeys("/p", "job")
    assert keys.node_id_from_key(keys.node("h-1-2")) == "h-1-2"


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (
            b"/p/other/nodes/h-1-2",
            "corrupt value at etcd key '/p/other/nodes/h-1-2': not under /p/job/nodes/",
        ),
        (b"/p/job/state", "corrupt value at etcd key '/p/job/state': not under /p/job/nodes/"),
        (
            b"/p/job/nodes/a/b",
            "corrupt value at etcd key '/p/job/nodes/a/b': the part after nodes/ is not a node id",
        ),
        (
            b"/p/job/nodes/",
            "corrupt value at etcd key '/p/job/nodes/': the part after nodes/ is not a node id",
        ),
        (
            b"/p/job/nodes/\xff",
            "corrupt value at etcd key '/p/job/nodes/\\\\xff': "
            "the part after nodes/ is not a node id",
        ),
    ],
)
def test_node_id_from_foreign_key(key: bytes, message: str) -> None:
    with pytest.raises(CorruptValueError) as exc:
        RunKeys("/p", "job").node_id_from_key(key)
    assert str(exc.value) == message


@pytest.mark.parametrize("bad", [-1, True, 1.0])
def test_store_prefix_rejects_bad_rounds(bad: object) -> None:
    with pytest.raises(ValueError, match=r"must be a non-negative int$"):
        RunKeys("/p", "job").store_prefix(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("user_key", "encoded"),
    [
        ("rank_0", b"rank_0"),
        ("", b""),
        ("a/b", b"a%2Fb"),
        ("..", b"%2E%2E"),
        ("../../state", b"%2E%2E%2F%2E%2E%2Fstate"),
        ("100%", b"100%25"),
        ("é", b"%C3%A9"),
        (b"\x00\xff", b"%00%FF"),
        ("torchelastic/role_info/0", b"torchelastic%2Frole_info%2F0"),
    ],
)
def test_encode_store_key_table(user_key: str | bytes, encoded: bytes) -> None:
    assert encode_store_key(user_key) == encoded
    assert decode_store_key(encoded) == (
        user_key.encode() if isinstance(user_key, str) else user_key
    )


@given(st.binary(max_size=64))
def test_store_key_encoding_is_inert_and_invertible(raw: bytes) -> None:
    encoded = encode_store_key(raw)
    assert b"/" not in encoded and b"." not in encoded
    assert decode_store_key(encoded) == raw
    prefix = b"/p/job/store/1/"
    key = join_store_key(prefix, raw)
    assert key.startswith(prefix) and b"/" not in key[len(prefix) :]


@given(st.binary(max_size=16), st.binary(max_size=16))
def test_store_key_encoding_is_injective(a: bytes, b: bytes) -> None:
    if a != b:
        assert encode_store_key(a) != encode_store_key(b)


@pytest.mark.parametrize("bad", [b"%", b"%2", b"%2f", b"%41", b"a/b", b"a.b", b"%zz"])
def test_decode_rejects_what_encode_never_makes(bad: bytes) -> None:
    with pytest.raises(ValueError, match=r"is not an encoded store key"):
        decode_store_key(bad)


def test_join_store_key_needs_a_folder_prefix() -> None:
    with pytest.raises(ValueError, match=r"^store prefix b'/p/job/store/1' must end with '/'$"):
        join_store_key(b"/p/job/store/1", "k")


def test_node_id_tag_keeps_ids_apart_when_host_and_pid_repeat() -> None:
    from coordinator.core.keys import make_node_id

    assert make_node_id("vm", 1, 0, "a1b2c3") == "vm-1-0-a1b2c3"
    assert make_node_id("vm", 1, 0, "a1b2c3") != make_node_id("vm", 1, 0, "0f0f0f")
    with pytest.raises(ValueError, match="node id tag 'XYZ' must be 1-16 lowercase hex"):
        make_node_id("vm", 1, 0, "XYZ")


# -- turn keys: the order the coordinator is chosen in ---------------------------------


_KEYS = RunKeys("/p", "job")
_IDS = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)


@given(st.integers(0, 2**63 - 2), st.integers(1, 2**40), _IDS, _IDS)
def test_a_node_that_saw_a_later_revision_has_a_smaller_turn_key(
    revision: int, later_by: int, first: str, later: str
) -> None:
    # The last key under turns/ coordinates: the node that came first, whatever its id.
    assert _KEYS.turn(min(revision + later_by, 2**63 - 1), later) < _KEYS.turn(revision, first)


@given(st.integers(0, 2**63 - 1), _IDS, _IDS)
def test_turn_keys_of_one_revision_are_ordered_by_node_id(revision: int, a: str, b: str) -> None:
    if a != b:
        assert (_KEYS.turn(revision, a) < _KEYS.turn(revision, b)) == (a < b)


def test_turn_key_layout() -> None:
    assert _KEYS.turns_prefix == b"/p/job/turns/"
    assert _KEYS.turn(0, "n1") == b"/p/job/turns/7fffffffffffffff.n1"
    assert _KEYS.turn(2**63 - 1, "n1") == b"/p/job/turns/0000000000000000.n1"


@pytest.mark.parametrize("bad", [-1, 2**63])
def test_turn_key_refuses_what_is_no_revision(bad: int) -> None:
    with pytest.raises(ValueError, match=f"revision {bad} is not an etcd revision"):
        _KEYS.turn(bad, "n1")


def test_turn_key_refuses_a_bad_node_id() -> None:
    with pytest.raises(ConfigError, match="node id"):
        _KEYS.turn(5, "../x")

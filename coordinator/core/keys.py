"""Where a run's data lives in etcd, and the validation that keeps runs apart.

Layout (documented for operators in ``docs/keys.md``)::

    <key_prefix>/<run_id>/state                          the agreed state (CAS on mod_revision)
    <key_prefix>/<run_id>/nodes/<node_id>                one record per node, on its lease
    <key_prefix>/<run_id>/turns/<seniority>.<node_id>    the order the coordinator is
                                                         chosen in, on the node's lease
    <key_prefix>/<run_id>/store/<round>/<encoded key>    the torch Store of one round
    <key_prefix>/<run_id>/progress/<node_id>             a node's last training progress,
                                                         on its lease (hang detection)
    <key_prefix>/<run_id>/events/<kind>/<…>              the run's timeline

The node, turn and progress keys hang on their node's lease; every other key of a run hangs on
the run's lease (``coordinator.core.run_lease``), so nothing of a run outlives its
retention.

Nothing in a key comes unescaped from user input: run ids, key prefixes and node ids use a
closed character set (so ``job`` can never be a prefix of ``job/x``'s keys: ``/`` is not
allowed in a run id), and Store keys from torch are percent-encoded. Everything here is
pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coordinator.core.errors import ConfigError, CorruptValueError

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "RunKeys",
    "decode_store_key",
    "encode_store_key",
    "join_store_key",
    "make_node_id",
    "round_store_prefix",
    "validate_key_prefix",
    "validate_node_id",
    "validate_run_id",
]

DEFAULT_KEY_PREFIX = "/etcd-elastic"

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._-]+")
_MAX_PREFIX_LEN = 256
# Host part of a node id is cut so that "<host>-<pid>-<counter>" stays within 128 chars.
_MAX_HOST_LEN = 80
_MAX_REVISION = 2**63 - 1  # etcd revisions are int64
_ID_RULE = "use 1-128 characters from A-Z a-z 0-9 . _ - starting with a letter or digit"

# Bytes left as they are in an encoded Store key: letters, digits, '_' and '-'. Every other
# byte (including '/', '.', '%' and anything non-ASCII) becomes "%XX" with upper-case hex.
_SAFE_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a valid run id (``--rdzv-id``).

    Raises:
        ConfigError: not 1-128 characters of ``A-Z a-z 0-9 . _ -`` starting with a letter
            or digit.
    """
    if not isinstance(run_id, str) or not _ID_RE.fullmatch(run_id):
        raise ConfigError(f"rdzv_id {run_id!r} is invalid: {_ID_RULE}")
    return run_id


def validate_key_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid ``key_prefix`` (e.g. ``/etcd-elastic``).

    A valid prefix starts with ``/``, has no trailing ``/``, at most 256 characters, and
    one or more segments of ``A-Z a-z 0-9 . _ -`` that are not ``.`` or ``..``.

    Raises:
        ConfigError: names the prefix and the broken rule.
    """
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise ConfigError(f"rdzv_conf key_prefix={prefix!r} is invalid: it must start with '/'")
    if len(prefix) > _MAX_PREFIX_LEN:
        raise ConfigError(
            f"rdzv_conf key_prefix={prefix!r} is invalid: "
            f"it is longer than {_MAX_PREFIX_LEN} characters"
        )
    if prefix.endswith("/"):
        raise ConfigError(f"rdzv_conf key_prefix={prefix!r} is invalid: it must not end with '/'")
    for segment in prefix[1:].split("/"):
        if not segment:
            raise ConfigError(
                f"rdzv_conf key_prefix={prefix!r} is invalid: it has an empty segment ('//')"
            )
        if segment in (".", "..") or not _SEGMENT_RE.fullmatch(segment):
            raise ConfigError(
                f"rdzv_conf key_prefix={prefix!r} is invalid: segment {segment!r} must use "
                "characters from A-Z a-z 0-9 . _ - and not be '.' or '..'"
            )
    return prefix


def validate_node_id(node_id: str) -> str:
    """Return ``node_id`` if it has the node-id form (same charset and length as run ids).

    Raises:
        ConfigError: the id is not 1-128 characters of ``A-Z a-z 0-9 . _ -`` starting with
            a letter or digit.
    """
    if not isinstance(node_id, str) or not _ID_RE.fullmatch(node_id):
        raise ConfigError(f"node id {node_id!r} is invalid: {_ID_RULE}")
    return node_id


def make_node_id(host: str, pid: int, counter: int, tag: str = "") -> str:
    """Return the node id ``<host>-<pid>-<counter>`` (``…-<tag>`` with a tag) for an agent.

    ``host`` is sanitized: characters outside ``A-Z a-z 0-9 . _ -`` become ``-``, leading
    characters that are not a letter or digit are dropped, it is cut to 80 characters, and
    an empty result becomes ``node``. ``tag`` (lowercase hex) keeps ids unique where host
    and pid repeat: containers on the host's network share its name and are all pid 1.

    Raises:
        ValueError: ``pid`` or ``counter`` is negative, or ``tag`` is not lowercase hex.
    """
    if pid < 0 or counter < 0:
        raise ValueError(f"pid {pid} and counter {counter} must not be negative")
    if tag and not re.fullmatch(r"[0-9a-f]{1,16}", tag):
        raise ValueError(f"node id tag {tag!r} must be 1-16 lowercase hex digits")
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", host)
    clean = re.sub(r"^[^A-Za-z0-9]+", "", clean)[:_MAX_HOST_LEN] or "node"
    suffix = f"-{tag}" if tag else ""
    return validate_node_id(f"{clean}-{pid}-{counter}{suffix}")


def encode_store_key(user_key: str | bytes) -> bytes:
    """Percent-encode a torch Store key so it is a single, inert key segment.

    Why percent-encoding rather than base64: keys stay readable in ``etcdctl get`` output
    (torch's keys are mostly ``[A-Za-z0-9_]`` and pass through unchanged), the mapping is
    injective because ``%`` itself is encoded, and the result never contains ``/`` or
    ``.``, so no key (``../x``, ``a/b``, ``..``) can leave its round's folder or look like
    a path step. ``str`` keys are UTF-8 encoded first, as torch's C++ stores do, so
    ``"é"`` and ``b"\\xc3\\xa9"`` name the same key.
    """
    raw = user_key.encode("utf-8") if isinstance(user_key, str) else bytes(user_key)
    return b"".join(bytes((b,)) if b in _SAFE_BYTES else b"%%%02X" % b for b in raw)


def decode_store_key(encoded: bytes) -> bytes:
    """Invert :func:`encode_store_key`.

    Raises:
        ValueError: ``encoded`` is not something :func:`encode_store_key` produces.
    """
    out = bytearray()
    i = 0
    while i < len(encoded):
        b = encoded[i]
        if b in _SAFE_BYTES:
            out.append(b)
            i += 1
            continue
        hex_part = encoded[i + 1 : i + 3]
        if b != ord("%") or len(hex_part) != 2 or not re.fullmatch(rb"[0-9A-F]{2}", hex_part):
            raise ValueError(f"{encoded!r} is not an encoded store key (at byte {i})")
        value = int(hex_part, 16)
        if value in _SAFE_BYTES:
            raise ValueError(f"{encoded!r} is not an encoded store key (at byte {i})")
        out.append(value)
        i += 3
    return bytes(out)


def join_store_key(prefix: bytes, user_key: str | bytes) -> bytes:
    """Return the etcd key of Store key ``user_key`` under a store ``prefix``.

    ``prefix`` must end with ``/`` (as :meth:`RunKeys.store_prefix` does), so every result
    starts with ``prefix`` and holds no further ``/``.

    Raises:
        ValueError: ``prefix`` does not end with ``/``.
    """
    if not prefix.endswith(b"/"):
        raise ValueError(f"store prefix {prefix!r} must end with '/'")
    return prefix + encode_store_key(user_key)


def round_store_prefix(store_root: bytes, round: int) -> bytes:
    """``<store_root><round>/``: the folder of one round's Store (ends with ``/``).

    Raises:
        ValueError: ``round`` is not a non-negative int, or ``store_root`` does not end
            with ``/``.
    """
    if isinstance(round, bool) or not isinstance(round, int) or round < 0:
        raise ValueError(f"round {round!r} must be a non-negative int")
    if not store_root.endswith(b"/"):
        raise ValueError(f"store root {store_root!r} must end with '/'")
    return store_root + str(round).encode("ascii") + b"/"


@dataclass(frozen=True)
class RunKeys:
    """The etcd keys of one run. Validates both parts at construction.

    Raises:
        ConfigError: ``key_prefix`` or ``run_id`` is invalid.
    """

    key_prefix: str
    run_id: str

    def __post_init__(self) -> None:
        validate_key_prefix(self.key_prefix)
        validate_run_id(self.run_id)

    @property
    def run_prefix(self) -> bytes:
        """``<key_prefix>/<run_id>/``: every key of the run starts with it."""
        return f"{self.key_prefix}/{self.run_id}/".encode("ascii")

    @property
    def state(self) -> bytes:
        """The state key, changed only by compare-and-swap."""
        return self.run_prefix + b"state"

    @property
    def nodes_prefix(self) -> bytes:
        """``…/nodes/``: the folder of per-node records."""
        return self.run_prefix + b"nodes/"

    def node(self, node_id: str) -> bytes:
        """The record key of ``node_id``.

        Raises:
            ConfigError: ``node_id`` is not a valid node id.
        """
        return self.nodes_prefix + validate_node_id(node_id).encode("ascii")

    def node_id_from_key(self, key: bytes) -> str:
        """Return the node id of a node-record key of this run.

        Raises:
            CorruptValueError: ``key`` is not ``<nodes_prefix><valid node id>``.
        """
        shown = key.decode("utf-8", "backslashreplace")
        if not key.startswith(self.nodes_prefix):
            raise CorruptValueError(shown, f"not under {self.nodes_prefix.decode('ascii')}")
        tail = key[len(self.nodes_prefix) :]
        try:
            return validate_node_id(tail.decode("ascii"))
        except (UnicodeDecodeError, ConfigError):
            raise CorruptValueError(shown, "the part after nodes/ is not a node id") from None

    @property
    def turns_prefix(self) -> bytes:
        """``…/turns/``: one key per node, written with its node key, in the order the
        coordinator is chosen in (see :meth:`turn`)."""
        return self.run_prefix + b"turns/"

    def turn(self, revision: int, node_id: str) -> bytes:
        """The turn key of ``node_id``, which saw etcd at ``revision`` before it wrote its
        node key.

        A node that came later saw a later revision and so has a *smaller* key (ties go
        by node id): the last key under ``turns/`` is the most senior node, which
        coordinates, and every other node waits for the first key after its own. That
        key is one range read with a limit, which etcd answers from its index; the
        election recipe's "newest key created before mine" makes etcd sort the whole
        folder on every call (measured: 1.3 ms of etcd CPU per call at 1,000 nodes, so
        O(N^2) per formation).

        Raises:
            ValueError: ``revision`` is not a revision (0 to 2**63-1).
            ConfigError: ``node_id`` is not a valid node id.
        """
        if not 0 <= revision <= _MAX_REVISION:
            raise ValueError(f"revision {revision} is not an etcd revision")
        seniority = f"{_MAX_REVISION - revision:016x}"
        return self.turns_prefix + f"{seniority}.{validate_node_id(node_id)}".encode("ascii")

    @property
    def progress_prefix(self) -> bytes:
        """``…/progress/``: the folder of per-node progress records (hang detection).

        Apart from ``nodes/`` so that progress never wakes the coordinator's watch."""
        return self.run_prefix + b"progress/"

    def progress(self, node_id: str) -> bytes:
        """The progress key of ``node_id``.

        Raises:
            ConfigError: ``node_id`` is not a valid node id.
        """
        return self.progress_prefix + validate_node_id(node_id).encode("ascii")

    def node_id_from_progress_key(self, key: bytes) -> str:
        """Return the node id of a progress key of this run.

        Raises:
            CorruptValueError: ``key`` is not ``<progress_prefix><valid node id>``.
        """
        shown = key.decode("utf-8", "backslashreplace")
        if not key.startswith(self.progress_prefix):
            raise CorruptValueError(shown, f"not under {self.progress_prefix.decode('ascii')}")
        try:
            return validate_node_id(key[len(self.progress_prefix) :].decode("ascii"))
        except (UnicodeDecodeError, ConfigError):
            raise CorruptValueError(shown, "the part after progress/ is not a node id") from None

    @property
    def store_root(self) -> bytes:
        """``…/store/``: the folder holding every round's Store."""
        return self.run_prefix + b"store/"

    @property
    def events_prefix(self) -> bytes:
        """``…/events/``: the folder of the run's timeline (see ``coordinator.core.events``)."""
        return self.run_prefix + b"events/"

    def event(self, event_id: str) -> bytes:
        """The key of timeline entry ``event_id`` (``<kind>/<node id>/<n>``: segments of
        the node-id character set, made by ``coordinator.core.events.event_id``).

        Raises:
            ConfigError: a segment is not of the node-id form.
        """
        for segment in event_id.split("/"):
            validate_node_id(segment)
        return self.events_prefix + event_id.encode("ascii")

    def store_prefix(self, round: int) -> bytes:
        """``…/store/<round>/``: the folder of one round's Store (ends with ``/``).

        Raises:
            ValueError: ``round`` is not a non-negative int.
        """
        return round_store_prefix(self.store_root, round)

    def store_key(self, round: int, user_key: str | bytes) -> bytes:
        """The etcd key of Store key ``user_key`` in ``round`` (see :func:`encode_store_key`)."""
        return join_store_key(self.store_prefix(round), user_key)

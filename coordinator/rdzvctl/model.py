"""What ``rdzvctl`` reads: one run's keys as a snapshot, and the runs under a key prefix.

Reading is the only I/O here (:func:`read_run`, :func:`list_runs`); everything that
interprets a snapshot (:func:`phase`, :func:`joining`, ...) is pure. A value that does
not decode never stops a read: it becomes an entry of :attr:`RunSnapshot.errors` naming
the key (and of :attr:`RunSnapshot.unreadable_keys`), so ``list`` can go on with the
other runs and ``status`` can show, after the error, what does decode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from coordinator.core.errors import ConfigError, CorruptValueError
from coordinator.core.keys import RunKeys, validate_run_id
from coordinator.core.progress import NodeProgress, decode_progress
from coordinator.core.state import NodeInfo, RdzvState, decode_node, decode_state

if TYPE_CHECKING:
    # Types only: the pure parts (phase, split_run_keys, ...) need no grpc.
    from coordinator.core.etcd_client import EtcdClient, KeyValue

__all__ = [
    "PHASES",
    "NodeView",
    "RunList",
    "RunSnapshot",
    "decode_nodes",
    "decode_progresses",
    "joining",
    "list_runs",
    "phase",
    "read_run",
    "split_run_keys",
]

PHASES = ("empty", "forming", "complete", "closed", "unreadable")
"""What :func:`phase` answers: neither state nor node keys (leftovers at most) / a round
is being formed / the last round completed and runs / the run is over / the state key
holds a value that does not decode."""


@dataclass(frozen=True)
class NodeView:
    """One live node key, as etcd holds it.

    Attributes:
        info: the decoded record.
        lease: the lease the key is bound to (etcd's metadata, not the record's copy).
        ttl_left: seconds the lease has left (-1: expired or revoked), None if not asked.
        create_revision, mod_revision: etcd's revisions of the key.
    """

    info: NodeInfo
    lease: int
    create_revision: int
    mod_revision: int
    ttl_left: int | None = None

    @property
    def node_id(self) -> str:
        return self.info.node_id


@dataclass(frozen=True)
class RunSnapshot:
    """One run's keys, read in two requests (state, then nodes).

    Attributes:
        keys: the run's key layout.
        state: the decoded state key; None when the key is absent or unreadable.
        state_mod_revision: the state key's mod_revision (0: absent), the CAS token.
        state_revision, nodes_revision: etcd's header revision of each read; a watch that
            follows applies only changes newer than the read that covered the key.
        nodes: live node records, oldest key first (the coordinator is the first).
        store_keys: how many keys the run's torch Store holds (all rounds).
        progress: readable progress records (``progress/``), by node id.
        event_keys: how many events the run's timeline holds (events/).
        foreign_keys: keys under the run that are not state, nodes/, progress/, store/ or
            events/.
        errors: one message per value that did not decode, each naming its key.
        unreadable_keys: the keys of those values, as text.
    """

    keys: RunKeys
    state: RdzvState | None
    state_mod_revision: int
    state_revision: int
    nodes: tuple[NodeView, ...]
    nodes_revision: int
    store_keys: int = 0
    progress: tuple[NodeProgress, ...] = ()
    foreign_keys: tuple[str, ...] = ()
    event_keys: int = 0
    errors: tuple[str, ...] = ()
    unreadable_keys: tuple[str, ...] = ()

    @property
    def run_id(self) -> str:
        return self.keys.run_id

    @property
    def revision(self) -> int:
        """The newest revision this snapshot reflects."""
        return max(self.state_revision, self.nodes_revision)

    @property
    def exists(self) -> bool:
        """Whether any key of the run exists (or did not decode)."""
        return bool(
            self.state_mod_revision
            or self.nodes
            or self.store_keys
            or self.event_keys
            or self.foreign_keys
            or self.errors
        )

    @property
    def effective_state(self) -> RdzvState:
        """The state, or the empty one (round 0, open) when the key is absent."""
        return self.state if self.state is not None else RdzvState()

    def node(self, node_id: str) -> NodeView | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)


def joining(snapshot: RunSnapshot) -> tuple[str, ...]:
    """Live nodes asking for the next round (``state.round + 1``), oldest key first."""
    target = snapshot.effective_state.round + 1
    return tuple(n.node_id for n in snapshot.nodes if n.info.wanted_round == target)


def phase(snapshot: RunSnapshot) -> str:
    """One of :data:`PHASES` for the run.

    ``forming`` follows the coordinator's rule for an *open* round (docs/protocol.md):
    nothing has completed yet, or a live participant of the last round asked for the next
    one (it re-rendezvouses), or no participant is alive and someone asks. Newcomers alone
    do not open a round while the participants run: then the run is ``complete`` and the
    newcomers are on the wait list.
    """
    state = snapshot.state
    if state is None and snapshot.state_mod_revision:
        return "unreadable"
    if state is not None and state.closed:
        return "closed"
    if state is None and not snapshot.nodes:
        return "empty"
    current = snapshot.effective_state
    if current.round == 0 or not current.participants:
        return "forming"  # nothing formed yet, or in this incarnation
    askers = set(joining(snapshot))
    alive = {n.node_id for n in snapshot.nodes}
    live_prev = [p for p in current.participants if p in alive]
    if askers and (not live_prev or any(p in askers for p in live_prev)):
        return "forming"
    return "complete"


def decode_nodes(
    keys: RunKeys, kvs: list[KeyValue]
) -> tuple[tuple[NodeView, ...], tuple[CorruptValueError, ...]]:
    """Decode node keys; returns the readable ones and one error per unreadable one."""
    nodes: list[NodeView] = []
    errors: list[CorruptValueError] = []
    for kv in kvs:
        shown = kv.key.decode("utf-8", "backslashreplace")
        try:
            node_id = keys.node_id_from_key(kv.key)
            info = decode_node(shown, kv.value, kv.create_revision)
            if info.node_id != node_id:
                raise CorruptValueError(
                    shown, f"node_id {info.node_id!r} in the value differs from the key"
                )
        except CorruptValueError as exc:
            errors.append(exc)
            continue
        nodes.append(NodeView(info, kv.lease, kv.create_revision, kv.mod_revision))
    nodes.sort(key=lambda n: n.create_revision)
    return tuple(nodes), tuple(errors)


def decode_progresses(
    keys: RunKeys, kvs: list[KeyValue]
) -> tuple[tuple[NodeProgress, ...], tuple[CorruptValueError, ...]]:
    """Decode progress keys, sorted by node id; one error per unreadable one."""
    out: list[NodeProgress] = []
    errors: list[CorruptValueError] = []
    for kv in kvs:
        shown = kv.key.decode("utf-8", "backslashreplace")
        try:
            node_id = keys.node_id_from_progress_key(kv.key)
            record = decode_progress(shown, kv.value)
            if record.node_id != node_id:
                raise CorruptValueError(
                    shown, f"node_id {record.node_id!r} in the value differs from the key"
                )
        except CorruptValueError as exc:
            errors.append(exc)
            continue
        out.append(record)
    return tuple(sorted(out, key=lambda p: p.node_id)), tuple(errors)


def read_run(client: EtcdClient, keys: RunKeys, *, lease_ttls: bool = False) -> RunSnapshot:
    """Read one run: state, node keys, how many store keys, anything foreign.

    Args:
        lease_ttls: also ask etcd how long each node's lease has left (one call per node).

    Raises:
        EtcdConnectionError: etcd did not answer (names the endpoints).
    """
    state_kv, state_revision = client.get(keys.state)
    node_kvs, nodes_revision = client.get_prefix(keys.nodes_prefix)
    store_keys, _ = client.count_prefix(keys.store_root)
    event_keys, _ = client.count_prefix(keys.events_prefix)
    turn_keys, _ = client.count_prefix(keys.turns_prefix)
    total, _ = client.count_prefix(keys.run_prefix)
    errors: list[CorruptValueError] = []
    state: RdzvState | None = None
    if state_kv is not None:
        try:
            state = decode_state(keys.state.decode(), state_kv.value)
        except CorruptValueError as exc:
            errors.append(exc)
    nodes, node_errors = decode_nodes(keys, node_kvs)
    errors.extend(node_errors)
    progress_kvs, _ = client.get_prefix(keys.progress_prefix)
    progress, progress_errors = decode_progresses(keys, progress_kvs)
    errors.extend(progress_errors)
    if lease_ttls:
        nodes = tuple(replace(n, ttl_left=client.lease_time_to_live(n.lease)) for n in nodes)
    foreign: tuple[str, ...] = ()
    known = store_keys + event_keys + turn_keys + len(node_kvs) + len(progress_kvs)
    if total > known + (state_kv is not None):
        # Rare (someone wrote under our prefix): only then list the run's keys by name.
        every, _ = client.get_prefix(keys.run_prefix, keys_only=True)
        foreign = tuple(
            kv.key.decode("utf-8", "backslashreplace")
            for kv in every
            if kv.key != keys.state
            and not kv.key.startswith(
                (
                    keys.nodes_prefix,
                    keys.turns_prefix,
                    keys.store_root,
                    keys.progress_prefix,
                    keys.events_prefix,
                )
            )
        )
    return RunSnapshot(
        keys=keys,
        state=state,
        state_mod_revision=state_kv.mod_revision if state_kv is not None else 0,
        state_revision=state_revision,
        nodes=nodes,
        nodes_revision=nodes_revision,
        store_keys=store_keys,
        progress=progress,
        event_keys=event_keys,
        foreign_keys=foreign,
        errors=tuple(str(e) for e in errors),
        unreadable_keys=tuple(e.key for e in errors),
    )


@dataclass(frozen=True)
class RunList:
    """The run ids found under a key prefix, and keys that belong to no valid run id."""

    run_ids: tuple[str, ...]
    foreign_keys: tuple[str, ...]


def split_run_keys(key_prefix: str, keys: list[bytes]) -> RunList:
    """Group keys under ``<key_prefix>/`` by run id (pure).

    A key whose first segment after the prefix is not a valid run id, or that has no
    ``/`` after the run id, is foreign: no run of ours can own it.
    """
    root = f"{key_prefix}/".encode()
    runs: list[str] = []
    foreign: list[str] = []
    for key in keys:
        shown = key.decode("utf-8", "backslashreplace")
        tail = key[len(root) :] if key.startswith(root) else b""
        head, sep, _ = tail.partition(b"/")
        try:
            run_id = validate_run_id(head.decode("ascii"))
        except (UnicodeDecodeError, ConfigError):
            run_id = ""
        if not sep or not run_id:
            foreign.append(shown)
        elif run_id not in runs:
            runs.append(run_id)
    return RunList(tuple(sorted(runs)), tuple(foreign))


def list_runs(client: EtcdClient, key_prefix: str) -> RunList:
    """Every run id with at least one key under ``key_prefix`` (keys only are read).

    Raises:
        EtcdConnectionError: etcd did not answer (names the endpoints).
    """
    kvs, _ = client.get_prefix(f"{key_prefix}/".encode(), keys_only=True)
    return split_run_keys(key_prefix, [kv.key for kv in kvs])

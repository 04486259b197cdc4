"""What a watch stream sends: the queued requests, and a probe whenever its member has
been silent for a while (the rule is :func:`~._liveness.watch_probe`).

Two kinds of probe, because of etcd's gRPC proxy: etcd answers a progress request on the
watch stream at once, but the proxy drops it (it logs "not supported request type by
gRPC proxy" and answers nothing), so a client whose only traffic is a quiet watch left
a healthy proxy as hung every two intervals. A member not yet known to answer progress
requests also gets a unary probe, a serializable count-only read of a watched key (etcd
answers it locally, without raft; the proxy from its cache, and the user may read the
key, or the watch would have been refused); a member that answered the read but not the
progress request is probed by reads alone from then on. Members that answer progress
requests are probed as before, and one frozen is left after the same two intervals.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from coordinator.core.errors import EtcdConnectionError
from coordinator.core.etcd_client._connection import Metadata
from coordinator.core.etcd_client._etcdrpc import etcdrpc
from coordinator.core.etcd_client._failover import RETRY, _status, classify_status
from coordinator.core.etcd_client._liveness import Probe, watch_probe

if TYPE_CHECKING:
    from coordinator.core.etcd_client._client import EtcdClient

__all__ = ["Prober", "is_progress"]

_PROGRESS = etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())


def is_progress(rs: Any) -> bool:
    """Whether a watch response answers a progress request (etcd sends it with watch id
    -1, for no watch in particular)."""
    return bool(rs.watch_id == -1 and not (rs.created or rs.canceled or rs.events))


class Prober:
    """The probes of one client's watch stream, and which each member answers.

    Per member: None while unknown (a progress request and a read), True once it answered
    a progress request (progress requests only), False once it answered a read but not the
    progress request sent with it (reads only: an etcd gRPC proxy). Thread-safe.
    """

    def __init__(self, client: EtcdClient) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._answers_progress: dict[int, bool] = {}

    def heard(self, index: int, response: Any) -> None:
        """The stream to member ``index`` got ``response``."""
        self._client._answered_by(index)
        if is_progress(response):
            with self._lock:
                self._answers_progress[index] = True

    def kinds(self, index: int, last_probe_unanswered: bool) -> tuple[bool, bool]:
        """(send a progress request, send a read) to member ``index`` now.
        ``last_probe_unanswered``: this stream probed it before and no progress answer
        came, though something else did (or it would have been left as hung)."""
        with self._lock:
            known = self._answers_progress.get(index)
            if known is None and last_probe_unanswered:
                known = self._answers_progress[index] = False
        return (known is not False, known is not True)

    def requests(
        self,
        index: int,
        requests: queue.SimpleQueue[Any],
        metadata: Metadata,
        leave_hung: Callable[[queue.SimpleQueue[Any], float], bool],
    ) -> Iterator[Any]:
        """What the stream to member ``index`` sends: the queued requests, and a probe
        whenever the member has been silent for a while; a member silent to that too is
        left (``leave_hung(requests, silent seconds)`` cancels the call; False if it is no
        longer the open one). Runs on gRPC's request thread of the call, so probing costs
        no thread of ours."""
        client = self._client
        interval = client.config.request_timeout
        opened = client._clock()
        probe_sent: float | None = None
        key: bytes | None = None  # a key watched on this stream: the user may read it
        while True:
            try:
                item = requests.get(timeout=interval / 2)
            except queue.Empty:
                now = client._clock()
                heard = max(client.last_heard(index), opened)
                step = watch_probe(now, heard, probe_sent, interval)
                if step is Probe.SEND:
                    progress, read = self.kinds(index, probe_sent is not None)
                    probe_sent = now
                    if read and key is not None:
                        self._read(index, key, metadata)
                    if progress or key is None:
                        yield _PROGRESS
                elif step is Probe.HUNG and leave_hung(requests, now - heard):
                    return
                continue
            if item is None:
                return
            if item.HasField("create_request"):
                key = item.create_request.key
            yield item

    def _read(self, index: int, key: bytes, metadata: Metadata) -> None:
        """A serializable count-only read of ``key`` on member ``index``; its answer (or
        an error status from etcd itself) counts as the member heard."""
        client = self._client
        request = etcdrpc.RangeRequest(key=key, serializable=True, count_only=True, limit=1)

        def done(future: Any) -> None:
            if future.cancelled():
                return
            error = future.exception()
            if error is None or (
                isinstance(error, grpc.RpcError) and classify_status(*_status(error)) != RETRY
            ):
                client._answered_by(index)

        try:
            stubs = client._channels.stubs(index)
        except EtcdConnectionError:
            return  # the client is closing: the stream ends anyway
        timeout = client.config.request_timeout
        stubs.kv.Range.future(request, timeout=timeout, metadata=metadata).add_done_callback(done)

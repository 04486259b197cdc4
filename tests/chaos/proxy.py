"""A TCP fault proxy between one agent and one etcd member (gRPC over HTTP/2 is plain TCP).

It listens on ``127.0.0.1:<free port>`` and forwards every connection to its target; the
harness switches its mode at any time:

``pass``
    forward both ways as received.
``blackhole``
    keep every connection open and forward nothing either way; new connections are
    accepted and get nothing either. Nothing is read meanwhile, so the kernel's buffers
    fill and TCP flow control stalls both peers, as on a cut link; what was in flight is
    delivered once the mode changes back (as TCP retransmission would).
``delay``
    every chunk, both ways, goes out ``delay`` seconds after it arrived (order kept);
    the member's answers may have a delay of their own (``answer_delay``: a request
    applied at once whose answer comes too late, without depending on timing).
``reset``
    every open connection is closed with a TCP RST (``SO_LINGER`` 0) on both sides, and
    every new one is reset right after it is accepted, while the mode lasts.

One thread runs a selector over every socket of the proxy; memory is bounded (at most
``max_connections`` connections, and reading stops while a direction holds more than
``buffer_limit`` bytes). :meth:`close` stops the thread, joins it and closes everything.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["Mode", "ProxyStats", "TcpFaultProxy"]

_CHUNK = 65536
_MAX_WAIT = 0.5  # longest selector wait: bounds how late a stop is noticed if a wake is lost


class Mode(str, Enum):
    """What the proxy does to traffic; see the module docstring."""

    PASS = "pass"
    BLACKHOLE = "blackhole"
    DELAY = "delay"
    RESET = "reset"


@dataclass
class ProxyStats:
    """Counters for tests and the harness's log."""

    accepted: int = 0
    refused: int = 0
    reset: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


@dataclass
class _Direction:
    """Bytes flowing from ``src`` to ``dst``: (due time, chunk); an empty chunk is EOF."""

    src: socket.socket
    dst: socket.socket
    queue: collections.deque[tuple[float, bytes]] = field(default_factory=collections.deque)
    queued: int = 0
    src_eof: bool = False
    dst_shut: bool = False


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.connected = False
        self.up = _Direction(client, upstream)
        self.down = _Direction(upstream, client)

    def done(self) -> bool:
        return self.up.dst_shut and self.down.dst_shut


def _rst(sock: socket.socket) -> None:
    """Close with a TCP RST instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class TcpFaultProxy:
    """One listening port forwarding to ``target``; see the module docstring."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        max_connections: int = 64,
        buffer_limit: int = 4 << 20,
        name: str = "proxy",
    ) -> None:
        self.target = target
        self.name = name
        self._max_connections = max_connections
        self._buffer_limit = buffer_limit
        self._lock = threading.Lock()
        self._mode = Mode.PASS
        self._delay = 0.0
        self._answer_delay = 0.0
        self._stop = False
        self._closed = False
        self.failure: BaseException | None = None
        self.stats = ProxyStats()
        self._listener = socket.create_server((host, 0), backlog=128)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: list[_Conn] = []
        self._masks: dict[socket.socket, int] = {}
        self.port: int = self._listener.getsockname()[1]
        self.endpoint = f"{host}:{self.port}"
        self._thread = threading.Thread(target=self._run, name=f"{name} :{self.port}", daemon=True)
        self._thread.start()

    # -- control (any thread) -------------------------------------------------------------

    def set_mode(
        self, mode: Mode, delay: float = 0.0, *, answer_delay: float | None = None
    ) -> None:
        """Switch to ``mode`` (``delay`` seconds for :attr:`Mode.DELAY`, ``answer_delay``
        for the member's answers: ``delay`` unless given); takes effect at once for every
        open and every new connection."""
        answers = delay if answer_delay is None else answer_delay
        if delay < 0 or answers < 0:
            raise ValueError(f"proxy delay must be >= 0 seconds, got {min(delay, answers)}")
        delaying = mode is Mode.DELAY
        with self._lock:
            self._mode = mode
            self._delay, self._answer_delay = (delay, answers) if delaying else (0.0, 0.0)
        self._wake()

    @property
    def mode(self) -> Mode:
        with self._lock:
            return self._mode

    def open_connections(self) -> int:
        """Connections currently forwarded (or held)."""
        with self._lock:
            return len(self._conns)

    def check(self) -> None:
        """Raise RuntimeError if the proxy thread died."""
        if self.failure is not None:
            raise RuntimeError(
                f"{self.name} :{self.port}: proxy thread died: {self.failure!r}"
            ) from self.failure

    def close(self) -> None:
        """Stop the thread, join it, close every socket; then :meth:`check`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stop = True
        self._wake()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            raise RuntimeError(f"{self.name} :{self.port}: proxy thread did not stop in 10 s")
        for conn in self._conns:
            _rst(conn.client)
            _rst(conn.upstream)
        self._conns.clear()
        self._masks.clear()
        self._sel.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self.check()

    def __enter__(self) -> TcpFaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake is pending anyway) or closed
            self._wake_w.send(b"x")

    # -- the loop (proxy thread only) --------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            # No silent death: the harness asks (check, close) and fails loudly.
            self.failure = exc
            raise

    def _loop(self) -> None:
        while True:
            with self._lock:
                stop, mode = self._stop, self._mode
            if stop:
                return
            if mode is Mode.RESET:
                self._reset_all()
            now = time.monotonic()
            if mode is not Mode.BLACKHOLE:
                self._flush(now)
            self._register(mode)
            events = self._sel.select(self._timeout(mode, now))
            now = time.monotonic()
            # The delay as of now, not of this turn's start: a chunk that arrived after
            # set_mode() returned must get the new delay even when the select woke for
            # it and for the mode change in one batch (or the wake was lost).
            with self._lock:
                delays = {"client": self._delay, "up": self._answer_delay}
            for key, mask in events:
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                else:
                    conn, which = key.data
                    self._on_ready(conn, which, mask, now + delays[which])

    def _timeout(self, mode: Mode, now: float) -> float:
        """Until the next chunk falls due; chunks already due wait on writability."""
        if mode is Mode.BLACKHOLE:
            return _MAX_WAIT
        dues = [
            d.queue[0][0]
            for c in self._conns
            for d in (c.up, c.down)
            if d.queue and d.queue[0][0] > now
        ]
        return min([_MAX_WAIT, *(due - now for due in dues)])

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # e.g. EMFILE: the client sees a reset, as from a full server
            # The mode as of this accept, not of this turn's start: a connection made
            # after set_mode() returned must see the new mode.
            if self.mode is Mode.RESET or len(self._conns) >= self._max_connections:
                self.stats.refused += 1
                _rst(client)
                continue
            client.setblocking(False)
            upstream = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            upstream.setblocking(False)
            err = upstream.connect_ex(self.target)
            if err not in (0, errno.EINPROGRESS):
                # The member is down: the client sees a reset, as if it had been refused.
                self.stats.refused += 1
                _rst(client)
                upstream.close()
                continue
            self.stats.accepted += 1
            conn = _Conn(client, upstream)
            conn.connected = err == 0
            with self._lock:
                self._conns.append(conn)

    def _register(self, mode: Mode) -> None:
        """Read where there is room (never in blackhole); write where a due chunk waits
        or a connect is pending."""
        now = time.monotonic()
        for conn in self._conns:
            for sock, inbound, outbound in (
                (conn.client, conn.up, conn.down),
                (conn.upstream, conn.down, conn.up),
            ):
                mask = 0
                if (
                    mode is not Mode.BLACKHOLE
                    and not inbound.src_eof
                    and inbound.queued < self._buffer_limit
                ):
                    mask |= selectors.EVENT_READ
                connecting = sock is conn.upstream and not conn.connected
                due = mode is not Mode.BLACKHOLE and outbound.queue and outbound.queue[0][0] <= now
                if connecting or due:
                    mask |= selectors.EVENT_WRITE
                self._interest(sock, mask, (conn, "client" if sock is conn.client else "up"))

    def _interest(self, sock: socket.socket, mask: int, data: object) -> None:
        # Selectors refuse an empty mask: no interest means not registered.
        current = self._masks.get(sock, 0)
        if mask == current:
            return
        if current == 0:
            self._sel.register(sock, mask, data)
        elif mask == 0:
            self._sel.unregister(sock)
        else:
            self._sel.modify(sock, mask, data)
        if mask:
            self._masks[sock] = mask
        else:
            self._masks.pop(sock, None)

    def _on_ready(self, conn: _Conn, which: str, mask: int, due: float) -> None:
        if conn not in self._conns:
            return  # aborted earlier in this batch of events
        sock, inbound = (conn.client, conn.up) if which == "client" else (conn.upstream, conn.down)
        if which == "up" and not conn.connected and mask & selectors.EVENT_WRITE:
            if conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                self._abort(conn)  # the member is down: reset the client, as refused
                return
            conn.connected = True
        if not mask & selectors.EVENT_READ:
            return  # writes happen in _flush, on every turn of the loop
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._abort(conn)
            return
        if not data:
            inbound.src_eof = True
        elif which == "client":
            self.stats.bytes_up += len(data)
        else:
            self.stats.bytes_down += len(data)
        inbound.queue.append((due, data))
        inbound.queued += len(data)

    def _flush(self, now: float) -> None:
        """Send every chunk that is due; pass EOFs on; drop connections that are done."""
        for conn in list(self._conns):
            for direction in (conn.up, conn.down):
                if direction.dst is conn.upstream and not conn.connected:
                    continue
                if not self._send_due(direction, now):
                    self._abort(conn)
                    break
            else:
                if conn.done():
                    self._drop(conn, graceful=True)

    def _send_due(self, direction: _Direction, now: float) -> bool:
        """Send what is due to ``direction.dst``; False if the connection broke."""
        queue = direction.queue
        while queue and queue[0][0] <= now:
            due, chunk = queue[0]
            try:
                if not chunk:
                    direction.dst.shutdown(socket.SHUT_WR)
                    direction.dst_shut = True
                    queue.popleft()
                    continue
                sent = direction.dst.send(chunk)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            direction.queued -= sent
            if sent < len(chunk):
                queue[0] = (due, chunk[sent:])
                return True
            queue.popleft()
        return True

    def _reset_all(self) -> None:
        for conn in list(self._conns):
            self.stats.reset += 1
            self._abort(conn)

    def _abort(self, conn: _Conn) -> None:
        self._drop(conn, graceful=False)

    def _drop(self, conn: _Conn, *, graceful: bool) -> None:
        """Forget ``conn``: close both sockets, with a FIN (done) or a RST (abort)."""
        for sock in (conn.client, conn.upstream):
            self._interest(sock, 0, None)
            if graceful:
                with contextlib.suppress(OSError):
                    sock.close()
            else:
                _rst(sock)
        with self._lock:
            if conn in self._conns:
                self._conns.remove(conn)

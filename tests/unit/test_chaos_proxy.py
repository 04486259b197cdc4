"""The chaos suite's TCP fault proxy on real loopback sockets, in front of an echo server."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from coordinator.etcd_server import free_port
from tests.chaos.proxy import Mode, TcpFaultProxy

QUIET = 0.4  # how long "nothing arrives" is watched; far above loopback latency


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            while data := sock.recv(65536):
                sock.sendall(data)
        except OSError:
            pass  # reset by the proxy: that is what some tests do


class _EchoServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = False  # server_close joins every handler thread
    block_on_close = True


@contextlib.contextmanager
def _echo_server() -> Iterator[tuple[str, int]]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield "127.0.0.1", int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    with _echo_server() as address:
        yield address


@pytest.fixture
def proxy(echo: tuple[str, int]) -> Iterator[TcpFaultProxy]:
    before = set(threading.enumerate())
    p = TcpFaultProxy(echo, name="test-proxy")
    try:
        yield p
    finally:
        p.close()
        leaked = [t.name for t in threading.enumerate() if t not in before and t.is_alive()]
        # Echo handler threads end when the proxy's reset reaches them.
        assert not [n for n in leaked if n.startswith("test-proxy")], leaked


def _connect(p: TcpFaultProxy) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    sock.settimeout(5)
    return sock


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise AssertionError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _nothing_arrives(sock: socket.socket) -> bool:
    sock.settimeout(QUIET)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(5)
    return False


def test_pass_forwards_both_ways(proxy: TcpFaultProxy) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"hello")
        assert _recv_exactly(sock, 5) == b"hello"
    assert proxy.stats.accepted == 1
    assert proxy.stats.bytes_up == proxy.stats.bytes_down == 5


def test_a_megabyte_passes_through_a_small_buffer_in_order() -> None:
    """Partial sends and the buffer limit (reading pauses while a direction is full)."""
    with (
        _echo_server() as address,
        TcpFaultProxy(address, buffer_limit=16384) as p,
        _connect(p) as sock,
    ):
        payload = bytes(range(256)) * 4096
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        assert _recv_exactly(sock, len(payload)) == payload
        sender.join(timeout=10)


def test_blackhole_holds_traffic_of_open_and_new_connections_until_pass(
    proxy: TcpFaultProxy,
) -> None:
    with _connect(proxy) as old:
        old.sendall(b"a")
        assert _recv_exactly(old, 1) == b"a"
        proxy.set_mode(Mode.BLACKHOLE)
        old.sendall(b"b")
        new = _connect(proxy)  # accepted: a cut link does not refuse
        with new:
            new.sendall(b"c")
            assert _nothing_arrives(old)
            assert _nothing_arrives(new)
            assert proxy.open_connections() == 2
            proxy.set_mode(Mode.PASS)
            assert _recv_exactly(old, 1) == b"b"
            assert _recv_exactly(new, 1) == b"c"


def test_delay_adds_latency_each_way_and_keeps_order(proxy: TcpFaultProxy) -> None:
    proxy.set_mode(Mode.DELAY, 0.25)
    with _connect(proxy) as sock:
        start = time.monotonic()
        for part in (b"1", b"2", b"3"):
            sock.sendall(part)
        assert _recv_exactly(sock, 3) == b"123"
        took = time.monotonic() - start
    assert 0.5 <= took < 3.0, f"round trip took {took:.3f} s through two 0.25 s delays"


def test_answer_delay_holds_the_answers_and_passes_the_requests(proxy: TcpFaultProxy) -> None:
    # A request applied at once whose answer misses its deadline, with no timing margin
    # to lose: the echo server has the bytes at once, the client gets them only later.
    proxy.set_mode(Mode.DELAY, 0.0, answer_delay=30.0)
    with _connect(proxy) as sock:
        sock.sendall(b"q")
        assert _nothing_arrives(sock)
        deadline = time.monotonic() + 10  # the echo's answer reached the proxy: held there
        while proxy.stats.bytes_down < 1:
            assert time.monotonic() < deadline, "the request never reached the server"
            time.sleep(0.02)
        proxy.set_mode(Mode.DELAY, 0.0, answer_delay=0.0)
        sock.sendall(b"r")
        assert _nothing_arrives(sock), "an answer overtook the one still held"


class _DeafProxy(TcpFaultProxy):
    """A proxy whose thread is never woken by a mode change: it learns of one only when
    traffic (or its longest wait) wakes it, as when the wake and the data land in one
    batch of the selector's events."""

    def _wake(self) -> None:
        pass


def test_a_chunk_sent_after_set_mode_gets_the_new_delay_even_in_the_same_wakeup(
    echo: tuple[str, int],
) -> None:
    # CI failure: the delay was read at the start of the loop's turn, so a request sent
    # right after set_mode(DELAY) could go out undelayed (a 1.2 s round trip took 0.6 s).
    with _DeafProxy(echo, name="deaf-proxy") as p, _connect(p) as sock:
        sock.sendall(b"w")
        assert _recv_exactly(sock, 1) == b"w"  # the thread is back in its select
        p.set_mode(Mode.DELAY, 0.3)
        start = time.monotonic()
        sock.sendall(b"d")
        assert _recv_exactly(sock, 1) == b"d"
        took = time.monotonic() - start
    assert took >= 0.6, f"round trip took {took:.3f} s through two 0.3 s delays"


def test_reset_resets_open_connections_and_new_ones_until_pass(proxy: TcpFaultProxy) -> None:
    with _connect(proxy) as old:
        old.sendall(b"x")
        assert _recv_exactly(old, 1) == b"x"
        proxy.set_mode(Mode.RESET)
        with pytest.raises(ConnectionResetError):
            old.recv(1)
    # Reset at connect, or at the first read.
    with pytest.raises(ConnectionResetError), _connect(proxy) as new:
        new.sendall(b"y")
        new.recv(1)
    assert proxy.stats.reset >= 1 and proxy.stats.refused >= 1
    proxy.set_mode(Mode.PASS)
    with _connect(proxy) as again:
        again.sendall(b"z")
        assert _recv_exactly(again, 1) == b"z"


def test_a_target_that_is_down_resets_the_client() -> None:
    with TcpFaultProxy(("127.0.0.1", free_port())) as p:
        with pytest.raises((ConnectionResetError, BrokenPipeError)), _connect(p) as sock:
            sock.sendall(b"q")
            if sock.recv(1) == b"":
                raise ConnectionResetError("closed")
        assert p.stats.accepted + p.stats.refused == 1


def test_close_stops_the_thread_and_is_idempotent(echo: tuple[str, int]) -> None:
    p = TcpFaultProxy(echo, name="closing-proxy")
    sock = _connect(p)
    sock.sendall(b"k")
    assert _recv_exactly(sock, 1) == b"k"
    p.close()
    p.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("closing-proxy")]
    with sock, pytest.raises(ConnectionResetError):
        sock.recv(1)
    with pytest.raises(ValueError, match="delay must be >= 0"):
        p.set_mode(Mode.DELAY, -1.0)

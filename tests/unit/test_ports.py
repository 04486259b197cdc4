"""free_ports: distinct ports, in the asked range, and a clear error when there are none."""

from __future__ import annotations

import socket

import pytest

from coordinator.core.ports import free_ports


def test_ports_asked_together_are_distinct_and_bindable() -> None:
    for _ in range(50):
        ports = free_ports(9)
        assert len(set(ports)) == 9
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[0]))  # each was given back


def test_ports_within_a_range_stay_in_it() -> None:
    ports = free_ports(6, within=(20000, 32000))
    assert len(set(ports)) == 6 and all(20000 <= p < 32000 for p in ports)


def test_a_range_too_small_for_the_count_names_itself() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=rf"no 1 free TCP ports in \({port}, {port + 1}\)"):
            free_ports(1, within=(port, port + 1))


def test_an_address_that_is_not_ours_names_itself() -> None:
    with pytest.raises(OSError, match=r"no free TCP port could be bound on '192\.0\.2\.1'"):
        free_ports(1, host="192.0.2.1")

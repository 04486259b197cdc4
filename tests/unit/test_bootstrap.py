"""The workers' bootstrap store the agent hosts: any free port, or --master-port, and one
clear error when that port is taken."""

from __future__ import annotations

import socket

import pytest

from agent.workers.bootstrap import BootstrapStoreError, host_bootstrap_store


def test_listens_on_a_free_port_before_any_worker() -> None:
    server = host_bootstrap_store("127.0.0.1", None)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=2):
            pass  # listening: a worker that comes first does not back off
    finally:
        del server


def test_a_master_port_in_use_is_one_line_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BootstrapStoreError) as info:
            host_bootstrap_store("127.0.0.1", port)
    message = str(info.value)
    assert message.startswith(f"cannot listen for the workers' bootstrap store on port {port}: ")
    assert message.endswith("; choose another --master-port")
    assert "\n" not in message

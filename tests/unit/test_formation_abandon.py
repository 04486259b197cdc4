"""A formation the loop abandoned (a stop, a membership change) starts nothing more: no
rank exchange, no bootstrap store on the fixed ``--master-port``, no pre-flight check;
and a check process handed over just as it was abandoned is ended at once (issue 21,
item 10). The faults land at their worst moments: the stop arrives as the round
completes, and as the check process is handed over."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.rendezvous import RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

from agent.config import LaunchConfig
from agent.health.preflight import Preflight
from agent.health.verdict import Verdict
from agent.loop.phase import Phase
from agent.loop.rounds import Formed, form_round
from agent.store import Store
from agent.workers.bootstrap import BootstrapHost
from coordinator.core.ports import free_port
from coordinator.torch_adapter.surface import ForeignSurface


class Handler:
    """A rendezvous whose round completes as the loop abandons the formation."""

    use_agent_store = False

    def __init__(self) -> None:
        self.phase: Phase[Formed] | None = None
        self.store = HashStore()
        self.abandon_in_rendezvous = True

    def next_rendezvous(self) -> RendezvousInfo:
        if self.abandon_in_rendezvous and self.phase is not None:
            self.phase.abandon()  # the stop request lands as the round completes
        return RendezvousInfo(self.store, 0, 1, RendezvousStoreInfo("127.0.0.1", 0))


class RecordingPreflight(Preflight):
    """Records whether a check started; optionally abandons the phase as it starts."""

    def __init__(self, phase_of: Callable[[], Phase[Formed] | None], abandon: bool) -> None:
        super().__init__(
            timeout=5, quarantine_s=1, env={}, node_id="n", addr="127.0.0.1", quarantine=None
        )
        self._phase_of = phase_of
        self._abandon = abandon
        self.checks = 0
        self.killed_at_once = False

    def check(
        self, store: Store, *, on_abandon: Callable[[Callable[[], None]], None], **_: Any
    ) -> Verdict:
        self.checks += 1
        phase = self._phase_of()
        if self._abandon and phase is not None:
            phase.abandon()  # the stop lands as the check process is handed over
        killed: list[bool] = []
        on_abandon(lambda: killed.append(True))
        self.killed_at_once = bool(killed)
        return Verdict(())


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _run(handler: Handler, preflight: Preflight | None, host: BootstrapHost, port: int) -> Any:
    config = LaunchConfig(
        1, 1, 1, "train.py", master_port=port, local_addr="127.0.0.1", rdzv_backend="etcd-v3"
    )
    ticket = host.next_formation()
    phase: Phase[Formed] = Phase(
        "rendezvous",
        lambda p: form_round(handler, ForeignSurface(), config, p, ticket, preflight),  # type: ignore[arg-type]
        lambda: None,
    )
    handler.phase = phase
    phase.start()
    phase._thread.join(30)
    assert phase.done
    return phase


def test_a_stop_as_the_round_completes_binds_nothing_and_starts_no_check() -> None:
    handler, host, port = Handler(), BootstrapHost(), free_port("127.0.0.1")
    preflight = RecordingPreflight(lambda: handler.phase, abandon=False)
    phase = _run(handler, preflight, host, port)
    with pytest.raises(Exception, match="abandoned"):
        phase.result()
    assert _free(port), "the abandoned formation bound --master-port"
    assert preflight.checks == 0
    assert handler.store.num_keys() == 0  # not even the rank exchange began


def test_a_check_process_handed_over_as_the_stop_lands_is_ended_at_once() -> None:
    handler, host, port = Handler(), BootstrapHost(), free_port("127.0.0.1")
    handler.abandon_in_rendezvous = False
    preflight = RecordingPreflight(lambda: handler.phase, abandon=True)
    _run(handler, preflight, host, port)
    assert preflight.checks == 1
    assert preflight.killed_at_once
    host.release()  # what the loop does once it abandoned the formation
    assert _free(port)


def test_the_next_formation_binds_the_port_the_last_round_held() -> None:
    # --master-port: one port for every round; the last round's server held it while
    # the next round formed, and group rank 0's agent exited 1 with EADDRINUSE.
    host, port = BootstrapHost(), free_port("127.0.0.1")
    first = host.next_formation()
    assert first.serve("127.0.0.1", port) == port
    assert not _free(port)
    second = host.next_formation()
    assert second.serve("127.0.0.1", port) == port
    with pytest.raises(Exception, match="abandoned"):
        first.serve("127.0.0.1", port)  # void: a newer formation hosts it
    host.release()
    assert _free(port)

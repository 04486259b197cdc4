"""The result exchange on a store of torch's (in memory): every node reaches the judge's
verdict, the keys stay under the round's prefix, and over the bootstrap store the judge of
a failed check holds the verdict until the others have read it (its agent re-forms at
once, which stops the server)."""

from __future__ import annotations

import threading
import time

from torch._C._distributed_c10d import HashStore, TCPStore
from torch.distributed import DistStoreError

from agent.health.exchange import exchange_on_bootstrap, exchange_results, round_prefix
from agent.health.verdict import NodeResult, Thresholds, Verdict
from agent.workers.bootstrap import BootstrapHost


def _result(rank: int) -> NodeResult:
    if rank == 1:
        return NodeResult(rank, f"n{rank}", "127.0.0.1", error="the check process exited")
    return NodeResult(rank, f"n{rank}", "127.0.0.1", devices="cpu", matmul_s=0.01)


def _three(body: object) -> dict[int, tuple[Verdict, bool]]:
    out: dict[int, tuple[Verdict, bool]] = {}
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, body(r)))  # type: ignore[operator]
        for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_the_round_prefix_is_the_check_processes_and_per_round() -> None:
    assert round_prefix(7) == "etcd_elastic/health/7/"
    assert round_prefix(7) != round_prefix(8)


def test_every_node_reaches_the_judges_verdict_under_the_given_prefix() -> None:
    store = HashStore()
    members = ["n0", "n1", "n2"]
    out = _three(
        lambda r: exchange_results(store, _result(r), 3, members, Thresholds(), 30.0, "p/")
    )
    assert [judged for _, judged in (out[r] for r in range(3))] == [True, False, False]
    for verdict, _ in out.values():
        assert [n.passed for n in verdict.nodes] == [True, False, True]
        assert verdict.nodes[1].reason == "the check process exited"
    assert store.check([f"p/result/{r}" for r in range(3)] + ["p/verdict"])
    assert store.num_keys() == 4


def test_over_the_bootstrap_store_the_others_read_a_failed_verdict_before_it_goes() -> None:
    host = BootstrapHost()
    port = host.next_formation().serve("127.0.0.1", None)
    spy = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)

    def node(rank: int) -> tuple[Verdict, bool]:
        got = exchange_on_bootstrap(
            ("127.0.0.1", port), 5, _result(rank), 3, ["n0", "n1", "n2"], Thresholds(), 30.0
        )
        if rank == 0:
            # Every other node said it read the verdict before the judge returned.
            assert spy.check([f"{round_prefix(5)}preflight/read/{r}" for r in (1, 2)])
            host.release()  # what its agent does next: re-form, stop the server
        return got

    try:
        out = _three(node)
    finally:
        host.release()
    assert sorted(out) == [0, 1, 2]
    for verdict, _ in out.values():
        assert [n.passed for n in verdict.nodes] == [True, False, True]


def test_a_node_waiting_for_the_verdict_when_the_judges_agent_goes_ends_at_once() -> None:
    # The worst moment for the exchange: a node has published its result and waits for
    # the verdict when group rank 0's agent, which hosts the store and judges, is gone
    # (killed, or re-forming). Its wait must end with an error at once, not at the
    # exchange's timeout (2 x 30 s + 30 s here), and its phase then re-forms.
    host = BootstrapHost()
    port = host.next_formation().serve("127.0.0.1", None)
    ended: list[BaseException] = []
    took: list[float] = []

    def node() -> None:
        started = time.monotonic()
        try:
            exchange_on_bootstrap(
                ("127.0.0.1", port), 9, _result(2), 3, ["n0", "n1", "n2"], Thresholds(), 30.0
            )
        except Exception as exc:  # what the formation's phase turns into a re-formation
            ended.append(exc)
        took.append(time.monotonic() - started)

    waiting = threading.Thread(target=node)
    waiting.start()
    spy = TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    spy.wait([f"{round_prefix(9)}preflight/result/2"])  # it published, and now waits
    host.release()
    waiting.join(60)
    assert not waiting.is_alive()
    assert len(ended) == 1 and isinstance(ended[0], DistStoreError), ended
    assert took[0] < 30.0, took  # far under the exchange's own timeout of 90 s

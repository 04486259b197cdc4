"""The result exchange on a store of torch's (in memory): every node reaches the judge's
verdict, the keys stay under the round's prefix, and over the bootstrap store the judge of
a failed check holds the verdict until the others have read it (its agent re-forms at
once, which stops the server)."""

from __future__ import annotations

import threading

from torch._C._distributed_c10d import HashStore, TCPStore

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

"""How a join ends when it does not end in a rank: the error for each of
:func:`~coordinator.core.join_decision.decide_node`'s verdicts, with its one-line message.

Pure: the handler's join loop asks :func:`join_error` after each decision and raises what
it returns (leaving the run first when told to). The messages are pinned by the tests of
the handler's error paths.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.errors import (
    EtcdElasticError,
    JoinTimeoutError,
    RunClosedError,
    RunEndedWhileWaitingError,
)
from coordinator.core.join_decision import NodeAction, is_spare
from coordinator.core.state import RdzvState

__all__ = ["JoinContext", "join_error"]


@dataclass(frozen=True)
class JoinContext:
    """Who is joining what, for the messages."""

    run_id: str
    node_id: str
    incarnation: int
    wanted: int  # the round asked for (0: none yet)
    join_timeout: float
    min_nodes: int


def join_error(
    action: NodeAction, state: RdzvState, ctx: JoinContext
) -> tuple[EtcdElasticError, bool] | None:
    """The error that ends the join for ``action`` in ``state``, and whether the node
    leaves the run (revokes its lease) before raising it; None: the join goes on."""
    run, node = repr(ctx.run_id), ctx.node_id
    if action is NodeAction.EXIT_GRACEFULLY and node in state.draining:
        return RunEndedWhileWaitingError(
            f"run {run}: node {node} was drained (rdzvctl drain): it leaves the run"
        ), False
    if action is NodeAction.EXIT_GRACEFULLY:
        how = "was drained" if state.close_mode == "drain" else "finished"
        where = "as a spare" if is_spare(state, node) else "outside its round"
        return RunEndedWhileWaitingError(
            f"run {run} {how} ({state.closed_reason or 'closed'}) while node {node} waited "
            f"{where}: nothing left to do"
        ), False
    if action is NodeAction.ERROR_CLOSED:
        reason = f" ({state.closed_reason})" if state.closed_reason else ""
        return RunClosedError(
            f"run {run} is closed{reason}: it admits no more nodes; start the job again "
            "(same --rdzv-id) once every node of this run has left"
        ), False
    if action is NodeAction.ERROR_SUPERSEDED:
        return RunClosedError(
            f"run {run} was started again as incarnation {state.incarnation} after this "
            f"node's incarnation {ctx.incarnation} ended: this node belongs to the ended one "
            "and never joins another; start it again"
        ), True
    if action is NodeAction.ERROR_TIMEOUT and state.closed:
        return JoinTimeoutError(
            f"run {run}: node {node} waited join_timeout={ctx.join_timeout:g} s to start the "
            f"run again as incarnation {ctx.incarnation}, but a node of the closed "
            f"incarnation {state.incarnation} ({state.closed_reason or 'closed'}) has not left"
        ), True
    if action is NodeAction.ERROR_TIMEOUT:
        return JoinTimeoutError(
            f"run {run}: node {node} was not admitted to round "
            f"{ctx.wanted or state.round + 1} within join_timeout={ctx.join_timeout:g} s "
            f"(min_nodes={ctx.min_nodes}, last completed round {state.round} had "
            f"{len(state.participants)} nodes)"
        ), True
    return None

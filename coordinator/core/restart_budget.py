"""The job's restart budget: ``--max-restarts`` counted once per round for the whole job.

torchrun counts restarts per node: each agent has its own ``--max-restarts``, so a node
that exits and joins again (or a fresh agent in its place) starts from a full budget, and
a job can restart without end (pytorch issues 147064, 135712). Here the count lives in the
rendezvous state (``RdzvState.restarts``, a :class:`RestartCount`), and every rule about
it is a pure function below:

* **counting** (:func:`counts`, :func:`counted`): the first node that sees the workers of
  round R fail (or hang) counts R with one guarded write through the state's one writer
  (:meth:`~coordinator.core.executor.StateExecutor.update`). A node that finds R counted,
  in its watched view or in the value a lost race returns, writes nothing: one count per
  round, however many nodes see it. Only the round the state holds is counted: the run
  re-formed without a node that reports a failure of an older round, and whoever re-formed
  it counted or did not count that round already. A closed run counts nothing.
* **deciding** (:func:`restarts_left`): a failure of round R is judged against the budget
  as it was before R was counted, ``max_restarts - used (+1 if R is counted and not given
  back)``, so every node of R reaches the same verdict (restart, or give up) whether it
  reads the state before or after the count of R landed.
* **giving back** (:func:`settled`, :func:`restart_refunded`): when the round after R
  forms with fewer nodes than R, R's failure followed a node's departure (its peers'
  collectives broke before its lease ended), a membership change, which is free
  (DESIGN §5). The coordinator applies it in the commit that completes that round: no
  write of its own.
* a new incarnation of the run starts with nothing counted (its state is written fresh).

Costs (DESIGN §10): one write of the state per counted restart of the job, not per node.
The other nodes of the round skip the write when their view shows the round counted;
one whose view is behind loses one compare-and-swap (a transaction that writes nothing)
and reads the count in the same round trip. A healthy job writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.errors import CorruptValueError
from coordinator.generated import rendezvous_pb2 as pb

__all__ = [
    "RestartCount",
    "count_message",
    "count_of_message",
    "counted",
    "counted_before",
    "counts",
    "describe",
    "restart_refunded",
    "restarts_left",
    "settled",
]


@dataclass(frozen=True)
class RestartCount:
    """The restarts a job counted against ``--max-restarts`` in this incarnation.

    Attributes:
        used: counted restarts, those given back deducted.
        round: the last round whose failure was counted (0: none).
        refunded: that round's restart was given back (the next round formed smaller).
    """

    used: int = 0
    round: int = 0
    refunded: bool = False


def counted_before(count: RestartCount, round: int) -> int:
    """The job's counted restarts before a failure of ``round`` was counted."""
    return count.used - (1 if count.round == round and not count.refunded else 0)


def restarts_left(count: RestartCount, round: int, max_restarts: int) -> int:
    """How many counted restarts a failure of ``round`` may still use (0: give up)."""
    return max(0, max_restarts - counted_before(count, round))


def counts(count: RestartCount, round: int, state_round: int, closed: bool) -> bool:
    """Whether a failure of ``round`` is counted now, in a state at ``state_round``:
    the run is open, ``round`` is the state's round, and it was not counted yet."""
    return not closed and round >= 1 and round == state_round and count.round < round


def counted(count: RestartCount, round: int) -> RestartCount:
    """The count after a failure of ``round`` was counted."""
    return RestartCount(used=count.used + 1, round=round, refunded=False)


def restart_refunded(failed_group_size: int, next_group_size: int) -> bool:
    """Whether a counted restart is given back once the next round has formed.

    A node that dies (or is cut off) breaks its peers' collectives at once, so their
    workers fail and the restart is counted, while the rendezvous learns of the loss only
    when the node's lease ends, a TTL later. When the round after the failure has fewer
    nodes than the round the workers failed in, a node went away and the failure is put
    down to that membership change, which does not count (DESIGN §5). A genuine failure
    that happens to coincide with a departure gets one free restart; torch counts both.

    Args:
        failed_group_size: nodes in the round whose workers failed.
        next_group_size: nodes in the round that formed after the failure.

    Raises:
        ValueError: a size is below 1.
    """
    if failed_group_size < 1 or next_group_size < 1:
        raise ValueError(f"group sizes must be >= 1, got {failed_group_size} and {next_group_size}")
    return next_group_size < failed_group_size


def settled(
    count: RestartCount, completed_round: int, completed_size: int, next_size: int
) -> RestartCount:
    """The count once the round after ``completed_round`` (of ``completed_size`` nodes)
    forms with ``next_size`` nodes: ``completed_round``'s restart given back if it was
    counted and the group shrank (:func:`restart_refunded`)."""
    if count.round != completed_round or count.refunded or completed_size < 1 or next_size < 1:
        return count
    if not restart_refunded(completed_size, next_size):
        return count
    return RestartCount(used=count.used - 1, round=count.round, refunded=True)


def describe(count: RestartCount) -> str:
    """``count`` in words, for operators (``rdzvctl status``)."""
    back = ", given back: the next round was smaller" if count.refunded else ""
    last = f"the last in round {count.round}{back}" if count.round else "none yet"
    return f"{count.used} counted for the job ({last})"


def count_message(count: RestartCount) -> pb.RestartCount:
    """The stored form of ``count``."""
    return pb.RestartCount(used=count.used, round=count.round, refunded=count.refunded)


def count_of_message(key: str, msg: pb.RestartCount, state_round: int) -> RestartCount:
    """The count stored at ``key`` in a state at ``state_round`` (absent in values of
    schema_version < 4: nothing counted).

    Raises:
        CorruptValueError: a negative count, or a round the state has not reached.
    """
    if msg.used < 0 or not 0 <= msg.round <= state_round:
        raise CorruptValueError(
            key,
            f"restarts: {msg.used} used, last counted in round {msg.round}: not a count of "
            f"rounds 0..{state_round}",
        )
    return RestartCount(used=msg.used, round=msg.round, refunded=msg.refunded)

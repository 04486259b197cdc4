"""The agent's loop and its phases: join a round (:mod:`~agent.loop.rounds`), agree on
worker ranks through the round's store (:mod:`~agent.loop.ranks`), start the workers,
then wait on one event for a worker exit, a membership change or a stop request and turn
each wake-up into a step with the pure :func:`agent.loop.policy.next_step`. Every
blocking step runs as a :class:`~agent.loop.phase.Phase` the loop can abandon, so a
signal (:mod:`~agent.loop.stopping`) or a node lost ends any wait; how a run ends
(exit barrier, close, the root-cause report) lives in :mod:`~agent.loop.ending`."""

"""The agent's loop and its phases: join a round (:mod:`~agent.loop.rounds`), agree on
worker ranks through the round's store (:mod:`~agent.loop.ranks`), start the workers,
then wait on one event for a worker exit, a membership change or a stop request and turn
each wake-up into a step with the pure :func:`agent.loop.policy.next_step`. Every
blocking step runs as a :class:`~agent.loop.phase.Phase` the loop can abandon, so a
signal (:mod:`~agent.loop.stopping`) or a node lost ends any wait. The loop
(:mod:`~agent.loop.agent`) names each step it takes: a round formed
(:mod:`~agent.loop.formation`), a restart decided and counted (:mod:`~agent.loop.restarts`),
how a run ends and its exit code (:mod:`~agent.loop.exits`; the exit barrier, the close,
the root-cause report in :mod:`~agent.loop.ending`), the warm pool before the first join
(:mod:`~agent.loop.warmup`)."""

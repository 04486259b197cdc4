"""Is the job healthy? Hang detection (``--hang-timeout``): the workers' progress read
from the file they write (:mod:`etcd_elastic.progress`), the pure rules
(:mod:`~agent.health.hang_rules`) and the watch that declares a hang
(:mod:`~agent.health.hang`). The pre-flight check (``--health-check``): the pure verdict
(:mod:`~agent.health.verdict`), the check process (:mod:`~agent.health.check_worker`) and
the agent's side of the exchange (:mod:`~agent.health.preflight`)."""

"""Starting and watching one node's worker processes: the group and its states
(:mod:`~agent.workers.group`, :mod:`~agent.workers.state`), a start from a cold
``python`` or from a warm interpreter that has imported torch already
(:mod:`~agent.workers.starts`, :mod:`~agent.workers.warm`,
:mod:`~agent.workers.warm_interpreter`, :mod:`~agent.workers.warm_process`; copies forked
from a ready one are adopted as the agent's children, :mod:`~agent.workers.adopt`), the
log files and console tee
(:mod:`~agent.workers.logs`), the error files a failed worker leaves
(:mod:`~agent.workers.errorfile`) and the workers' bootstrap store on group rank 0
(:mod:`~agent.workers.bootstrap`). Knows nothing of etcd or of rounds."""

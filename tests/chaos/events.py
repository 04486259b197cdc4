"""Names of the history events the chaos checker reads, and the harness's own events.

Agent events are documented in ``agent/observe/journal.py``, worker events in
``tests/chaos/worker.py``. The harness (``src="harness"``) records:

``run_start`` {run, seed, faults, agents, nproc, min_nodes, max_nodes, lease_ttl,
step_s, endpoints, etcd}
    Before the first agent starts; the checker takes its bounds from here.
``agent_started`` {slot, agent_pid, master_port}
    An ``etcdrun`` process started in agent slot ``slot``. The harness does not know
    node ids: agent and worker events are tied to it by the agent's pid (``pid`` itself
    is every line's recording process, here the harness).
``agent_killed`` {slot, agent_pid, signal}
    The harness sent SIGKILL (the agent is dead from here) or SIGTERM (it leaves).
``agent_frozen`` / ``agent_thawed`` {slot, agent_pid}
    SIGSTOP / SIGCONT sent to the agent (its workers run on).
``agent_exited`` {slot, agent_pid, code}
    The harness saw the agent's exit (at most a poll interval after it happened).
``worker_killed`` {worker_pid, agent_pid}
    The harness SIGKILLed one worker.
``keys_deleted`` {prefix, deleted}
    The harness deleted every key under ``prefix`` (``etcdctl del --prefix``).
``auth_enabled`` {user, prefix}
    etcd has auth from here (a plan with ``etcd_role_revoked``): the agents go as
    ``user``, whose role has readwrite on ``prefix``.
``role_revoked`` {role} / ``role_granted`` {role}
    The role's permission on that prefix was revoked / granted again.
``orphan_alive`` {worker_pid, agent_pid, after_s}
    A worker still ran ``after_s`` seconds after its agent died (then the harness kills
    it); a ``no_orphan_workers`` violation in itself.
``proxy_mode`` {slot, mode, delay}
    The agent's etcd proxies switched mode (pass, blackhole, delay, reset).
``etcd_killed`` {member, role} / ``etcd_started`` {member}
    An etcd member was SIGKILLed (``role`` leader or follower) / is healthy again.
``etcd_frozen`` {member, role} / ``etcd_thawed`` {member}
    An etcd member was SIGSTOPped (it keeps its sockets open and answers nothing) /
    SIGCONTed.
``compacted`` {revision} / ``defragmented`` {member}
``fault_start`` {index, kind, target, other, duration, delay, inner, removes_node,
disruptive, pids}
    A planned fault begins; ``pids`` are the agent pids it is aimed at (to tell who
    "left" for ``rank0_stable``).
``fault_end`` {index, kind}
    The fault's own actions are over (members back, proxies passing, agent thawed);
    recovery may still be under way.
``trigger`` {index, what, after_s}
    A timed fault (``formation_fault``, ``rank_exchange_fault``) saw the moment it waits
    for (or not: ``what`` says so) and injects its second action ``after_s`` seconds
    after its start.
``settled`` {index, waited_s} / ``settle_timeout`` {index, waited_s, what}
    The job (did not) reach its steady state (every slot's agent in one round, all
    ranks stepping) before the next fault.
``harness_error`` {what}
    Something the harness itself could not do (a member that did not come back, a
    proxy thread that died); the run fails.
``teardown_start`` {}
    The harness starts stopping everything: nothing after this is judged.
``run_end`` {planned, executed, aborted}
    Faults planned and executed; ``aborted`` the reason the plan stopped early, or "".
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "AGENT_EXITED",
    "AGENT_FROZEN",
    "AGENT_KILLED",
    "AGENT_STARTED",
    "AGENT_THAWED",
    "FAULT_END",
    "FAULT_START",
    "HARNESS_ERROR",
    "KEYS_DELETED",
    "ORPHAN_ALIVE",
    "ROLE_GRANTED",
    "ROLE_REVOKED",
    "ROUND",
    "RUN_END",
    "RUN_START",
    "STEP",
    "TEARDOWN_START",
    "TRIGGER",
    "VIOLATION",
    "WORKERS_STARTED",
    "WORKERS_STOPPED",
    "WORKER_KILLED",
    "WORKER_START",
]

# agent
ROUND: Final = "round"
WORKERS_STARTED: Final = "workers_started"
WORKERS_STOPPED: Final = "workers_stopped"
# worker
WORKER_START: Final = "worker_start"
STEP: Final = "step"
VIOLATION: Final = "violation"
# harness
RUN_START: Final = "run_start"
AGENT_STARTED: Final = "agent_started"
AGENT_KILLED: Final = "agent_killed"
AGENT_FROZEN: Final = "agent_frozen"
AGENT_THAWED: Final = "agent_thawed"
AGENT_EXITED: Final = "agent_exited"
ORPHAN_ALIVE: Final = "orphan_alive"
WORKER_KILLED: Final = "worker_killed"
KEYS_DELETED: Final = "keys_deleted"
ROLE_REVOKED: Final = "role_revoked"
ROLE_GRANTED: Final = "role_granted"
FAULT_START: Final = "fault_start"
FAULT_END: Final = "fault_end"
TRIGGER: Final = "trigger"
HARNESS_ERROR: Final = "harness_error"
TEARDOWN_START: Final = "teardown_start"
RUN_END: Final = "run_end"

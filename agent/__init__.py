"""The elastic agent and its ``etcdrun`` launcher, in wings by concern.

=================  ===================================================================
``agent.cli``      the command line: flags and ``PET_*`` values, devices, the embedded
                   etcd of ``--standalone``, and :func:`~agent.cli.launcher.launch`,
                   which builds the handler and runs the loop
``agent.loop``     the loop and its phases: rendezvous, rank exchange, exit barrier,
                   the pure restart policy, how a run ends, signals as stop requests
``agent.workers``  starting and watching worker processes: cold and warm starts, logs,
                   error files, the workers' bootstrap store
``agent.health``   hang detection and the pre-flight check
``agent.observe``  metrics, the run's timeline events, the agent journal
=================  ===================================================================

The wings import one way, ``cli → loop → observe → health → workers``; each may also use
:mod:`agent.config` (the launch configuration) and :mod:`agent.store` (what the agent
needs of a round's Store). ``tests/unit/test_architecture.py`` checks it. What a training
script imports lives in :mod:`etcd_elastic`, never here.
"""

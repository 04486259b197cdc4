"""What the agent lets others see: Prometheus metrics (``--metrics-port``;
:mod:`~agent.observe.metrics`, :mod:`~agent.observe.metrics_server`), the run's timeline
events it records in etcd (:mod:`~agent.observe.timeline`), and the agent journal
(``ETCD_ELASTIC_JOURNAL``; :mod:`~agent.observe.journal`, :mod:`~agent.observe.recording`),
a local JSON-lines record of rounds, worker starts and exits for audits and for the
fault-injection suite. All of it is diagnostics: none of it may stop training."""

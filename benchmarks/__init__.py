"""Side-by-side rendezvous benchmarks: ours (etcd-v3) against torch's c10d and etcd-v2.

Run ``python -m benchmarks SCENARIO [options] --json``; see ``benchmarks.scenarios`` for
the JSON shape and ``docs/performance.md`` for the method and the numbers.
"""

__all__: list[str] = []

"""The fleet harness: N simulated agents running the real agent loop with stand-in
workers, against a real 3-member etcd, counting what each phase costs etcd from etcd's
own metrics (``docs/scale.md``). ``python -m benchmarks.fleet --help``."""

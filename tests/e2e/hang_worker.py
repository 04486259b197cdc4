"""A worker without torch for the hang-detection tests: reports a step every
``--step-seconds``; with ``--hang-at-step N`` it sleeps inside step N (after the step's
work, before reporting it) in the first attempt, when ``HANG_HERE`` is set in its
environment; ``--no-report`` never reports (a script that knows nothing of progress);
``--until FILE`` ends the loop early once FILE exists (a job the test stops). Appends
``<restart count> <last step>`` to ``--done`` when it finishes."""

from __future__ import annotations

import argparse
import os
import time

from etcd_elastic import report_progress


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--hang-at-step", type=int, default=-1)
    parser.add_argument("--no-report", action="store_true")
    parser.add_argument("--done", default="")
    parser.add_argument("--until", default="")
    args = parser.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hang = restart == 0 and bool(os.environ.get("HANG_HERE"))
    for step in range(args.steps):
        if args.until and os.path.exists(args.until):
            break
        time.sleep(args.step_seconds)
        if hang and step == args.hang_at_step:
            print(f"hanging in step {step} at {time.time():.3f}", flush=True)
            time.sleep(3600)
        if not args.no_report:
            report_progress(step)
    if args.done:
        with open(args.done, "a") as f:
            f.write(f"{restart} {args.steps - 1}\n")


if __name__ == "__main__":
    main()

"""Stand-in programs for the tests of deploy/: etcdrun, etcd, and Slurm's srun and scontrol.

Each is a small Python script written into a test's folder (put it first on PATH). Every
call appends one JSON line to ``$STANDIN_LOG``: the program, its arguments, its pid and
its environment. Their behaviour comes from the environment:

* ``etcdrun``: exits with the code at its ``SLURM_NODEID`` in ``STANDIN_EXIT_CODES``
  (comma-separated; default 0). With ``STANDIN_ETCD_UP`` (a FIFO) it first waits until
  the stand-in etcd runs, as a real agent waits for etcd. With ``STANDIN_READY`` (a FIFO
  the test reads) it writes one line there, then waits for SIGTERM and exits 143, as an
  agent stopped by Slurm does.
* ``etcd``: holds ``STANDIN_ETCD_UP`` open while it runs (blocking SIGTERM until then),
  and exits 0 on SIGTERM.
* ``srun``: runs its command once per task (``--ntasks``, default 1) at once, on the
  hosts of ``--nodelist`` or ``SLURM_JOB_NODELIST`` (comma-separated), with
  SLURM_STEP_ID, SLURM_PROCID, SLURM_NODEID and SLURMD_NODENAME set; forwards SIGTERM to
  them; exits with the highest exit code (128 + N for a task killed by signal N).
* ``scontrol``: ``show hostnames LIST`` prints LIST one host a line; ``requeue JOB``
  sends SIGTERM to every srun recorded so far, as Slurm stops the steps of a requeued job.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

__all__ = ["calls", "pet_variables", "write_standins"]

_COMMON = """\
import json, os, signal, sys

def record(program):
    line = json.dumps({"program": program, "argv": sys.argv[1:], "pid": os.getpid(),
                       "env": dict(os.environ)})
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(line + "\\n")
"""

_ETCDRUN = """
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
record("etcdrun")
if os.environ.get("STANDIN_ETCD_UP"):
    os.close(os.open(os.environ["STANDIN_ETCD_UP"], os.O_RDONLY))
if os.environ.get("STANDIN_READY"):
    with open(os.environ["STANDIN_READY"], "w") as ready:
        ready.write("ready\\n")
    signal.sigwait({signal.SIGTERM})
    sys.exit(143)
codes = os.environ.get("STANDIN_EXIT_CODES", "").split(",")
node = int(os.environ.get("SLURM_NODEID", "0"))
sys.exit(int(codes[node]) if node < len(codes) and codes[node] else 0)
"""

_ETCD = """
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
record("etcd")
up = os.open(os.environ["STANDIN_ETCD_UP"], os.O_RDWR)
signal.sigwait({signal.SIGTERM})
sys.exit(0)
"""

_SRUN = """
import subprocess
children = []
signal.signal(signal.SIGTERM, lambda signum, frame: [c.send_signal(signum) for c in children])
record("srun")
args = sys.argv[1:]
options = {}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    options[key] = value
with open(os.environ["STANDIN_LOG"]) as log:
    step = sum(1 for line in log if json.loads(line)["program"] == "srun") - 1
hosts = os.environ["SLURM_JOB_NODELIST"].split(",")
targets = options.get("--nodelist", os.environ["SLURM_JOB_NODELIST"]).split(",")
for task in range(int(options.get("--ntasks", "1"))):
    host = targets[task]
    env = dict(os.environ, SLURM_STEP_ID=str(step), SLURM_PROCID=str(task),
               SLURM_NODEID=str(hosts.index(host)), SLURMD_NODENAME=host)
    children.append(subprocess.Popen(args, env=env))
codes = [child.wait() for child in children]
sys.exit(max(code if code >= 0 else 128 - code for code in codes))
"""

_SCONTROL = """
record("scontrol")
args = sys.argv[1:]
if args[:2] == ["show", "hostnames"]:
    print("\\n".join(args[2].split(",")))
elif args[:1] == ["requeue"]:
    with open(os.environ["STANDIN_LOG"]) as log:
        steps = [json.loads(line)["pid"] for line in log if json.loads(line)["program"] == "srun"]
    for pid in steps:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
else:
    sys.exit(f"scontrol stand-in: {args} is not modelled")
"""

_PROGRAMS = {"etcdrun": _ETCDRUN, "etcd": _ETCD, "srun": _SRUN, "scontrol": _SCONTROL}


def write_standins(folder: Path, names: tuple[str, ...] = tuple(_PROGRAMS)) -> Path:
    """Write the stand-ins into ``folder`` (created) and return it, for PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.write_text(f"#!{sys.executable}\n{_COMMON}{_PROGRAMS[name]}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


def calls(log: Path, program: str | None = None) -> list[dict[str, Any]]:
    """The recorded calls, in order; only ``program``'s if given."""
    if not log.exists():
        return []
    found = [json.loads(line) for line in log.read_text().splitlines()]
    return [call for call in found if program is None or call["program"] == program]


def pet_variables(env: dict[str, str]) -> dict[str, str]:
    """The torchrun-style ``PET_*`` variables of an environment."""
    return {key: value for key, value in env.items() if key.startswith("PET_")}

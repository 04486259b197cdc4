"""Imported ahead by every warm interpreter of a chaos run (``--warm-modules
torch,chaos_stall``; this folder is on the agents' PYTHONPATH), it hangs one import on
purpose for the ``warm_import_stuck`` fault: the harness creates
``$CHAOS_STALL_DIR/stall-<agent pid>``, and the first warm interpreter of that agent to
get here takes the file and blocks for good, using no CPU, as an import stuck on a lock
or a network file system does. Every other import marks its interpreter as past its
preload (``ready-<pid>-<start time>``: pids wrap; its local rank inside) and returns
at once. Not a package of
the project: only the standard library."""

import os
import threading

_DIR = os.environ.get("CHAOS_STALL_DIR", "")
if _DIR:
    _ARM = os.path.join(_DIR, f"stall-{os.getppid()}")
    try:
        os.rename(_ARM, _ARM + ".taken")
    except OSError:
        # Not the one to hang: this interpreter is about to say it is ready. The harness
        # counts spares by this mark, not by their CPU time alone: on a loaded machine an
        # interpreter still importing can get no CPU for a second, and an import stuck
        # in an earlier fault uses none either. A copy the pool forks from a ready one
        # never imports: it marks itself as it is forked.
        def _mark_ready() -> None:
            with open(f"/proc/{os.getpid()}/stat") as stat:
                start = stat.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime
            with open(os.path.join(_DIR, f"ready-{os.getpid()}-{start}"), "w") as ready:
                ready.write(os.environ.get("LOCAL_RANK", ""))  # spares serve one local rank

        _mark_ready()
        os.register_at_fork(after_in_child=_mark_ready)
    else:
        with open(_ARM + ".taken", "w") as _taken:
            _taken.write(str(os.getpid()))  # the harness tells the stuck one from the others
        threading.Event().wait()

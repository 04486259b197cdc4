"""The probe a worker of the warm-start tests runs (``warm_support.write_probe``): it
records, as one JSON line on its stdout, everything a worker can observe about how it was
started (module globals, argv, sys.path, cwd, environment, signals, flags, threads,
torch's thread count, standard streams, descriptors, ...), then does what its first
argument says (exit with a code, raise, fail under torch's ``@record``, wait, talk).
``REPO`` is replaced by the repository's path before it is written.
"""

from __future__ import annotations

__all__ = ["PROBE"]

PROBE = r"""
import sys
_EARLY = sorted(sys.modules)
import json, os, signal, threading, time

_PRE = {m: m in sys.modules for m in ("torch", "numpy")}
if os.environ.get("PROBE_TORCH") == "1":
    import torch


def _status(*names):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in names:
                out[key] = value.strip()
    return out


def _record():
    import atexit, ctypes, faulthandler, gc, locale, re, resource, subprocess, warnings

    g = globals()
    pdeath = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(pdeath), 0, 0, 0)  # PR_GET_PDEATHSIG
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    fds = {}
    for name in os.listdir(listing):
        if int(name) != listing:
            with __import__("contextlib").suppress(OSError):
                fds[name] = os.readlink(f"/proc/self/fd/{name}")
    os.close(listing)
    child = subprocess.run(["/usr/bin/env", "-0"], stdout=subprocess.PIPE, check=True).stdout
    with open("/proc/self/environ", "rb") as f:
        exec_env = f.read()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    umask = os.umask(0o22)
    os.umask(umask)
    ours = (os.path.join(REPO, "agent"), os.path.join(REPO, "coordinator"))
    rec = {
        "name": __name__,
        "file": g.get("__file__", "<absent>"),
        "spec": re.sub(r" at 0x[0-9a-f]+", "", repr(g.get("__spec__", "<absent>"))),
        "loader": type(g.get("__loader__")).__name__,
        "cached": g.get("__cached__", "<absent>"),
        "package": g.get("__package__", "<absent>"),
        "doc": g.get("__doc__", "<absent>"),
        "builtins": type(g.get("__builtins__")).__name__,
        "dunders": sorted(k for k in g if k.startswith("__") and k.endswith("__")),
        "main_is_this": sys.modules["__main__"].__dict__ is g,
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "child_env": dict(kv.split("=", 1) for kv in child.decode().split("\0") if kv),
        "exec_env": dict(kv.split("=", 1) for kv in exec_env.decode().split("\0") if kv),
        "signals": {
            s.name: repr(signal.getsignal(s))
            for s in signal.valid_signals()
            if isinstance(s, signal.Signals) and s not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "sigmask": sorted(int(s) for s in mask),
        "sigstatus": _status("SigBlk", "SigIgn", "SigCgt"),
        "pdeathsig": pdeath.value,
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgrp() == os.getpid(),
        "ppid": os.getppid(),
        "flags": repr(sys.flags),
        "executable": sys.executable,
        "prefix": [sys.prefix, sys.base_prefix, sys.exec_prefix],
        "threads": threading.active_count(),
        "os_threads": len(os.listdir("/proc/self/task")),
        "ours": sorted(m for m in sys.modules
                       if m.split(".")[0] in ("agent", "coordinator", "warm_process")),
        "ours_files": sorted(
            m for m, mod in list(sys.modules.items())
            if str(getattr(mod, "__file__", None) or "").startswith(ours)
        ),
        "stdin": sys.stdin.read(),
        "stdio": [[s.encoding, s.errors, s.line_buffering, s.write_through, s.isatty()]
                  for s in (sys.stdout, sys.stderr)] + [[sys.stdin.encoding, sys.stdin.errors]],
        "fds": fds,
        "umask": umask,
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "rlimits": {n: resource.getrlimit(getattr(resource, n))
                    for n in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS")},
        "recursion": sys.getrecursionlimit(),
        "switch": sys.getswitchinterval(),
        "gc": [gc.isenabled(), list(gc.get_threshold())],
        "faulthandler": faulthandler.is_enabled(),
        "hooks": [repr(sys.excepthook), repr(sys.displayhook), repr(threading.excepthook)],
        "meta_path": [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path],
        "path_hooks": len(sys.path_hooks),
        "warnings": [repr(f) for f in warnings.filters],
        "atexit": atexit._ncallbacks(),
        "locale": locale.setlocale(locale.LC_ALL, None),
        "hash": hash("probe") if os.environ.get("PYTHONHASHSEED") else None,
        "pre_imported": _PRE,
        "early_modules": _EARLY,
        "modules": sorted(sys.modules),
    }
    if "torch" in g:
        rec["torch_threads"] = torch.get_num_threads()
        rec["torch_interop_threads"] = torch.get_num_interop_threads()
        rec["cuda_initialized"] = torch.cuda.is_initialized()
    print("PROBE " + json.dumps(rec), flush=True)


_record()
_action = sys.argv[1]
if _action.startswith("exit:"):
    sys.exit(int(_action[5:]))
elif _action.startswith("sysexit:"):
    sys.exit(_action[8:])
elif _action == "raise":
    def failing():
        raise RuntimeError("uncaught on purpose")
    failing()
elif _action == "record":
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        raise ValueError("probe failed on purpose")

    main()
elif _action in ("wait", "wait-handle"):
    if _action == "wait-handle":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print("started", flush=True)
    time.sleep(600)
elif _action == "talk":
    print("out one", flush=True)
    print("err one", file=sys.stderr, flush=True)
    print("out two", flush=True)
"""

"""``rdzvctl``: the operator's view of etcd-elastic runs (status, watch, list, close, drain,
gc).

The command line is parsed by :mod:`coordinator.rdzvctl.parser` and checked in
:mod:`coordinator.rdzvctl.cli` (exit code 2 on a bad value, before anything connects);
the commands run in :mod:`coordinator.rdzvctl.commands`, which reads through
:mod:`coordinator.rdzvctl.model`, follows in :mod:`coordinator.rdzvctl.watch`, writes
through :mod:`coordinator.rdzvctl.ops` and prints with :mod:`coordinator.rdzvctl.format`.
Exit codes::

    0  done
    1  run not found, a value does not decode, or the operation failed
    2  bad command line
    3  etcd unreachable, TLS or credentials refused (names the endpoints)

Start-up: this module (the console script's entry point) imports only the parser; grpc
and the etcd client load once a checked command is about to connect, so ``--help`` and
a bad command line answer without them.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn, TextIO

from coordinator.rdzvctl.cli import EXIT_OK, PROG, Options, parse_args

__all__ = ["main", "program", "run_command"]


def run_command(opts: Options, out: TextIO, err: TextIO) -> int:
    """Run a checked command; returns the exit code (errors are printed as one line)."""
    from coordinator.rdzvctl.commands import run

    return run(opts, out, err)


def _start(argv: Sequence[str] | None) -> Options:
    """Logging, gRPC's own log level, the checked command line (SystemExit if bad)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=os.environ.get("LOGLEVEL", "ERROR").upper(),
            format=f"{PROG}: %(levelname)s %(name)s: %(message)s",
        )
    # gRPC's C core logs each refused TLS handshake to stderr on its own (grpc >= 1.6x);
    # our error is the one line that names the endpoint and the fix. Set before grpc
    # loads (parse_args may load it); GRPC_VERBOSITY=INFO or DEBUG brings them back.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    return parse_args(sys.argv[1:] if argv is None else argv)


def _run(opts: Options) -> int:
    try:
        return run_command(opts, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        return EXIT_OK if opts.command == "watch" or opts.follow else 130


def main(argv: Sequence[str] | None = None) -> int:
    """The ``rdzvctl`` program. Returns the exit code (see the module docstring)."""
    return _run(_start(argv))


def program() -> NoReturn:
    """The ``rdzvctl`` console script and ``python -m coordinator.rdzvctl``: :func:`main`
    in a process of its own, which then exits with its code.

    Unlike :func:`main` (which tests call in their own process), it tunes the garbage
    collector for a short program whose imports make ~50,000 objects that live until
    it exits: collection is off while grpc, protobuf and the etcd client load (each
    collection would walk all of them again), and what they made is then frozen
    (``gc.freeze``), so neither a later collection nor the interpreter's last ones at
    exit walk it. This saves ≈ 30 ms of CPU per command (docs/performance.md); the
    exit is the ordinary one (atexit, flushed streams). The cost: the thousand or so
    objects that became garbage during the imports stay in memory until exit.
    """
    gc.disable()
    try:
        opts = _start(None)
        from coordinator.rdzvctl import commands  # noqa: F401  (its imports, while gc is off)
    finally:
        gc.freeze()
        gc.enable()
    sys.exit(_run(opts))

"""``rdzvctl``, the operator's command line: on the core only, never torch.

See :mod:`coordinator.rdzvctl.main` for the commands and exit codes.
"""

from coordinator.rdzvctl.main import main, program, run_command

__all__ = ["main", "program", "run_command"]

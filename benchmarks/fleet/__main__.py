"""``python -m benchmarks.fleet``: see :mod:`benchmarks.fleet.cli`."""

import sys

from benchmarks.fleet.cli import main

sys.exit(main())

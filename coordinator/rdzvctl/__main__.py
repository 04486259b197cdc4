"""``python -m coordinator.rdzvctl``: the same as the ``rdzvctl`` console script."""

import sys

from coordinator.rdzvctl.main import main

sys.exit(main())

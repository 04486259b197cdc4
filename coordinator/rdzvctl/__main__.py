"""``python -m coordinator.rdzvctl``: the same as the ``rdzvctl`` console script."""

from coordinator.rdzvctl.main import program

program()

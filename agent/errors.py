"""Exceptions the agent's wings share."""

from __future__ import annotations

__all__ = ["MembershipChanged"]


class MembershipChanged(Exception):
    """The nodes a phase waited on changed; the message says how. Not a failure of this
    node: the loop joins the next round without counting a restart."""

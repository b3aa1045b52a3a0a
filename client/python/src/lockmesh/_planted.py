"""Planted faults for the SDK conformance suite (client/conformance/README.md).

Switched on only by the conformance driver calling `plant`; the library reads no
environment variable for it, so an application never runs with one.
"""

from __future__ import annotations

DEADLINE_FROM_ANSWER = False


def plant(name: str) -> bool:
    """Switches on fault `name`; False if this SDK has none of that name.

    `deadline_from_answer`: the fence deadline counts from a keepalive's answer,
    not its send (the bug ADR-12 rules out)."""
    global DEADLINE_FROM_ANSWER
    if name == "deadline_from_answer":
        DEADLINE_FROM_ANSWER = True
        return True
    return False

"""What every part of the plan shares: its error type and how it prints counts."""

from __future__ import annotations

__all__ = ["PlanError", "human"]


class PlanError(RuntimeError):
    """A run cannot start as configured; the message lists every problem."""


def human(n: float) -> str:
    """``1.23B``, ``456.00M``, ``7.50k``: a count as the plan prints it."""
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"

"""The one exception type triedec raises for bad input or unsupported setups."""

from __future__ import annotations


class TriedecError(ValueError):
    """Bad input or an unsupported setup, with a message naming the problem.

    It subclasses ``ValueError`` so that callers who already catch that keep working.
    """


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1 (bools refused), else raise a clear error."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TriedecError(f"{name} must be a positive integer, got {value!r}")
    return value

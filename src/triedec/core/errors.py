"""The exception types triedec raises: :class:`TriedecError` for bad input or unsupported setups,
and its subclass :class:`StateFileError` for learned-state files that cannot be used (a fault of
whoever set the file up, not of a request that happens to need it)."""

from __future__ import annotations


class TriedecError(ValueError):
    """Bad input or an unsupported setup, with a message naming the problem.

    It subclasses ``ValueError`` so that callers who already catch that keep working.
    """


class StateFileError(TriedecError):
    """A learned-state file (or its directory) that cannot be used: unsafe ownership or mode,
    unreadable, corrupt, or saved for another model. The message names the path, so the server
    logs it and answers its client with a generic 500 (the operator's fault, never the client's,
    and paths are never shown to clients)."""


_SERVER = ("fastapi", "uvicorn", "prometheus_client")
EXTRAS = {"server": _SERVER, "bench": ("matplotlib", "httpx", "openai", *_SERVER)}
"""What each optional part of triedec needs beyond the core install (pyproject's extras)."""


def require_extra(extra: str, what: str) -> None:
    """Raise a clear :class:`TriedecError` naming ``pip install 'triedec[EXTRA]'`` when a module the
    extra brings is not installed (``what`` says who needs it, e.g. ``"triedec serve"``)."""
    import importlib.util

    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise TriedecError(f"{what} needs the '{extra}' extra, which is not installed (missing: "
                           f"{', '.join(missing)}): pip install 'triedec[{extra}]'")


def positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an int >= 1 (bools refused), else raise a clear error."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TriedecError(f"{name} must be a positive integer, got {value!r}")
    return value

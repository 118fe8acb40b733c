"""Where triedec keeps what it builds and measures (pure: the standard library only)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """triedec's cache directory (converted models, calibrations, the compiled kernel): the
    argument, ``$TRIEDEC_CACHE``, or the XDG cache."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("TRIEDEC_CACHE"):
        return Path(os.environ["TRIEDEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "triedec"

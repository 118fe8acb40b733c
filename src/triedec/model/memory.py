"""The process's heap: big buffers handed back to the system when freed, and freed pages
returned after a peak, so that RSS falls back after a burst (the server's large bodies, refused
prompts or long requests; loading's intermediate copies of the weights) instead of only ever
stepping up. glibc only (Linux); elsewhere both are no-ops.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and unmaps it
on free. By default that threshold rises to the size of any such block freed (up to 32 MiB), after
which 1 MiB request bodies and their parsed copies come from the heap and stay there. Fixing the
threshold keeps them out of the heap; ``malloc_trim`` returns free heap pages at the top of each
arena when the server goes idle, and once a model's weights are placed
(:func:`triedec.model.hugepages.place_weights`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger("triedec")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 10
"""blocks from this size up are mapped on their own and unmapped when freed (glibc's initial
default, kept fixed instead of rising)"""
TRIM_THRESHOLD = 4 << 20
"""free heap at the top of an arena beyond this is returned at once"""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018  (glibc has both; musl has neither)
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def tune_allocator() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (module doc); False where the C
    library is not glibc."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.info("could not set the allocator's thresholds; RSS may stay at its peaks")
    return ok


def release_memory() -> None:
    """Return free heap pages to the system (glibc's ``malloc_trim(0)``); a no-op elsewhere."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)

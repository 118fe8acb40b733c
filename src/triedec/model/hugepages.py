"""The packed weights of triedec's linears in memory advised for transparent huge pages.

A forward streams every weight byte once: ~500 MB a token for Qwen2.5-Coder-0.5B in ``int4-a8``.
On 4 KiB pages that is ~125,000 pages a forward, each a TLB miss and a page walk; on 2 MiB pages,
~250. Linux backs an anonymous mapping with huge pages where the mapping is advised so
(``madvise(MADV_HUGEPAGE)``; ``/sys/kernel/mm/transparent_hugepage/enabled`` ``always`` or
``madvise``, the usual defaults), but torch's allocator does not advise (unless
``THP_MEM_ALLOC_ENABLE=1``, for every allocation). :func:`place_weights` copies the buffers of
every linear triedec packed (:class:`~triedec.model.linears.LinearStandIn`: its codes, scales and
zeros) into one mapping so advised, 2 MiB-aligned, and points the modules at it: the same values,
so no bit of any forward changes, and one mapping, so at most one partly used huge page. What it
buys is measured by ``scripts/huge_pages.py`` (in one process, the two placements of the same
weights alternating; docs/kernels.md gives the run): most at one token, where the forward is
bound by reading the weights, little at 16, where it is bound by arithmetic.

Where the platform has no ``MADV_HUGEPAGE`` (not Linux), or the kernel refuses the advice, the
weights stay where they are. Where huge pages are off (``never``) the advice does nothing.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

from triedec.model.linears import LinearStandIn
from triedec.model.memory import release_memory

log = logging.getLogger("triedec")

HUGE_PAGE = 2 << 20
"""The size and alignment of an x86-64 transparent huge page (bytes)."""
ALIGN = 64
"""Each buffer's start in the mapping: a cache line, as the kernels' vector loads expect at most."""
_PLACED = "_triedec_huge_pages"
_MAPPINGS: set[int] = set()
"""The start of every mapping :func:`place_weights` made (each view's storage starts there)."""


def huge_pages_supported() -> bool:
    """Whether this platform can advise a mapping for transparent huge pages (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def _candidates(model: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    out = []
    for module in model.modules():
        if not isinstance(module, LinearStandIn) or getattr(module, _PLACED, False):
            continue
        for name, tensor in module._buffers.items():
            if tensor is not None and tensor.device.type == "cpu" and tensor.is_contiguous() \
                    and not tensor.requires_grad and tensor.numel() > 0:
                out.append((module, name, tensor))
    return out


def place_weights(model: nn.Module) -> int:
    """Move the buffers of ``model``'s packed linears (those not placed before) into one anonymous
    mapping advised for transparent huge pages; returns the bytes moved (0 where nothing moved:
    no such buffers, under 2 MiB of them, or no support). The values are copied unchanged; the old
    buffers are freed once nothing else holds them, and the heap's free pages are returned
    (:func:`~triedec.model.memory.release_memory`)."""
    if not huge_pages_supported():
        return 0
    found = _candidates(model)
    sizes = [-(-t.numel() * t.element_size() // ALIGN) * ALIGN for _, _, t in found]
    total = sum(sizes)
    if total < HUGE_PAGE:
        return 0
    try:
        mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # e.g. a kernel built without transparent huge pages
        log.info("weights stay on the allocator's pages: %s", exc)
        return 0
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    _MAPPINGS.add(whole.untyped_storage().data_ptr())
    at = -whole.data_ptr() % HUGE_PAGE
    with torch.no_grad():
        for (module, name, tensor), size in zip(found, sizes, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            view = whole[at : at + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            module._buffers[name] = view
            at += size
    for module in {id(m): m for m, _, _ in found}.values():
        setattr(module, _PLACED, True)
    found.clear()  # the last references to the old buffers: freed now
    release_memory()  # and their heap pages (with loading's other copies) back to the system
    log.debug("%.1f MiB of packed weights in one mapping advised for huge pages", total / 2**20)
    return total


def in_placed_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a mapping :func:`place_weights` made (for tests and reports)."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _MAPPINGS

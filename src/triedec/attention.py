"""Tree attention with a fixed reduction order: triedec's own compiled kernel.

:func:`tree_attention` computes, for each query and head, softmax-weighted values over exactly the
key slots that query sees, summing in an order fixed by each key's rank among them (see
``csrc/tree_attention.cpp``). A query therefore gets the same bits whatever else the call holds:
alone (plain decoding), at any depth of a draft tree of any shape, beside prompt-chunk rows, with
sliding windows or grouped-query heads. torch's sdpa gives no such promise (on this CPU a query
alone and the same query inside a call of 2-64 queries differ in the last bits), and a torch
upgrade could change how any of its kernels sum, so invariance rests on this file instead.

The kernel is C++ built with ``torch.utils.cpp_extension`` the first time it is needed (``make``
builds it during setup; about a minute with the C++ compiler; ``ninja`` comes with triedec's
dependencies) and cached under ``kernels/`` in triedec's cache (:func:`triedec.paths.cache_root`,
``~/.cache/triedec`` by default), one build per source, flags, torch version, Python and CPU.
Pure torch: nothing here knows transformers.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from triedec.errors import TriedecError
from triedec.paths import cache_root

SOURCE = Path(__file__).parent / "csrc" / "tree_attention.cpp"
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native")
"""``-ffp-contract=off``: no implicit fused multiply-adds (an element gets the same bits in a vector
lane as in a scalar tail); the kernel's own fused ones are explicit. ``-march=native``: the build is
for the CPU it runs on (the build directory names that CPU)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes the kernel runs (it computes in float32 and rounds each output once)."""

_log = logging.getLogger("triedec")
_lock = threading.Lock()
_module: ModuleType | None = None
_failure: str | None = None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_directory() -> Path:
    """Where the kernel for this source, these flags, this torch, this Python and this CPU is
    built: ``<cache>/kernels/tree_attention-<hash>`` under :func:`triedec.paths.cache_root`."""
    root = cache_root()
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 sys.version.encode(), platform.machine().encode(), _cpu_name().encode()):
        digest.update(part)
        digest.update(b"\0")
    return root / "kernels" / f"tree_attention-{digest.hexdigest()[:16]}"


def _put_ninja_on_path() -> None:
    """torch builds with the ``ninja`` found on PATH; triedec depends on the ``ninja`` package,
    whose binary is not on PATH when the virtual environment is not activated. Prepend it then."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([str(ninja.BIN_DIR), os.environ.get("PATH", "")])


def load_kernel(verbose: bool = False) -> ModuleType:
    """The compiled kernel, built on first use (thread-safe; later calls return it at once).
    Raises :class:`TriedecError` with the compiler's reason when it cannot be built."""
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _failure is not None:
                raise TriedecError(_failure)
            from torch.utils import cpp_extension

            _put_ninja_on_path()
            where = build_directory()
            where.mkdir(parents=True, exist_ok=True, mode=0o700)
            fresh = not any(where.glob("*.so"))
            if fresh:
                _log.warning("building triedec's tree-attention kernel in %s (once per machine, ~1 min)", where)
            try:
                _module = cpp_extension.load(name="triedec_tree_attention", sources=[str(SOURCE)],
                                             extra_cflags=list(CFLAGS), build_directory=str(where), verbose=verbose)
            except Exception as exc:  # compiler missing or failing: say so once, keep the reason
                _failure = (f"triedec's tree-attention kernel could not be built ({type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
                            "run scripts/setup.sh (it installs a C++ compiler)")
                raise TriedecError(_failure) from exc
    return _module


def kernel_available() -> bool:
    """Whether the kernel is built or can be built here (builds it if needed)."""
    try:
        load_kernel()
    except TriedecError:
        return False
    return True


def key_lists(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key slots each query sees, from bool ``visible [T, S]``: ``(offsets [T + 1] int64,
    indices int32)``, query t seeing ``indices[offsets[t]:offsets[t + 1]]`` (ascending). Computed
    once per forward and reused by every layer of the same type."""
    counts = visible.sum(dim=1)
    if bool((counts == 0).any()):
        raise TriedecError("every query must see at least one key")
    offsets = torch.zeros(visible.shape[0] + 1, dtype=torch.long)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    return offsets, visible.nonzero()[:, 1].to(torch.int32)


def tree_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   seen: tuple[torch.Tensor, torch.Tensor] | None, scale: float,
                   softcap: float | None = None) -> torch.Tensor:
    """Attention of ``query [1, heads, T, dim]`` over ``keys``/``values [1, kv_heads, S, dim]``
    (views are fine: only the feature dimension must be contiguous). ``seen`` is
    :func:`key_lists` of a bool ``[T, S]`` visibility, or None (every query sees every slot).
    ``heads`` must be a multiple of ``kv_heads`` (grouped-query heads read their group's K/V in
    place). ``softcap``: scores become ``softcap * tanh(score / softcap)``. Returns
    ``[1, T, heads, dim]`` in the query's dtype (transformers' attention layout). CPU tensors of a
    dtype in :data:`DTYPES`; nothing is mutated."""
    if query.dtype not in DTYPES:
        raise TriedecError(f"tree attention runs {[str(d) for d in DTYPES]}, not {query.dtype}")
    kernel = load_kernel()
    offsets, indices = seen if seen is not None else (None, None)
    out = kernel.tree_attention(query[0], keys[0], values[0], offsets, indices, float(scale), float(softcap or 0.0))
    return out[None]


def tree_attention_items(query: torch.Tensor, caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         bounds: Sequence[int], seen: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
                         scale: float, softcap: float | None = None) -> torch.Tensor:
    """:func:`tree_attention` for several items in one call (one parallel loop, one crossing into
    C++): item k's queries are ``query[:, :, bounds[k]:bounds[k + 1]]`` and attend over its own
    ``caches[k]`` (keys, values ``[1, kv_heads, S_k, dim]``) with its own ``seen[k]``. Every
    output is bit-identical to what :func:`tree_attention` gives that item alone. Returns ``[1, T,
    heads, dim]``; nothing is mutated."""
    if query.dtype not in DTYPES:
        raise TriedecError(f"tree attention runs {[str(d) for d in DTYPES]}, not {query.dtype}")
    kernel = load_kernel()
    out = kernel.tree_attention_items(query[0], [k[0] for k, _ in caches], [v[0] for _, v in caches], list(bounds),
                                      [None if s is None else s[0] for s in seen],
                                      [None if s is None else s[1] for s in seen], float(scale), float(softcap or 0.0))
    return out[None]

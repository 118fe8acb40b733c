"""triedec's compiled kernels (``csrc/``): the fixed-order tree attention
(:mod:`triedec.model.attention`), the row-wise RMS norm (:mod:`triedec.model.rmsnorm`) and the linears on
8-bit activations (:mod:`triedec.model.precision`), one C++ extension.

It is built with ``torch.utils.cpp_extension`` the first time a kernel is needed (``make`` builds
it during setup; about a minute with the C++ compiler; ``ninja`` comes with triedec's
dependencies) and cached under ``kernels/`` in triedec's cache (:func:`triedec.core.paths.cache_root`,
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
from pathlib import Path
from types import ModuleType

import torch

from triedec.core.errors import TriedecError
from triedec.core.paths import cache_root

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("tree_attention.cpp", "rms_norm.cpp", "a8_linears.cpp", "bindings.cpp")
"""The extension's translation units, in ``csrc/`` (``kernels.h`` declares what ``bindings.cpp``
binds)."""
HEADERS = ("kernels.h",)
OPENMP = torch.backends.openmp.is_available() and sys.platform.startswith("linux")
"""Whether the kernels are built with OpenMP: where torch runs its own ops on GNU OpenMP (Linux
wheels); elsewhere (macOS' compiler takes no plain ``-fopenmp``) they run on the calling thread."""
CFLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native", *(("-fopenmp",) if OPENMP else ()))
"""``-ffp-contract=off``: no implicit fused multiply-adds (an element gets the same bits in a vector
lane as in a scalar tail); the kernels' own fused ones are explicit. ``-march=native``: the build is
for the CPU it runs on (the build directory names that CPU). ``-fopenmp``: ``at::parallel_for`` runs
on torch's intra-op threads (``torch.set_num_threads``) only when the including file is compiled
with OpenMP; without it, it runs the whole range on the calling thread. The symbols resolve to the
OpenMP runtime torch itself loaded, so there is one thread pool. ``parallel_threads()`` says how
many threads a kernel's loop gets."""
NAME = "triedec_kernels"

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
    """Where the extension for these sources, these flags, this torch, this Python and this CPU is
    built: ``<cache>/kernels/triedec-<hash>`` under :func:`triedec.core.paths.cache_root`."""
    digest = hashlib.sha256()
    parts = [(CSRC / name).read_bytes() for name in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(CFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
                 platform.machine().encode(), _cpu_name().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_root() / "kernels" / f"triedec-{digest.hexdigest()[:16]}"


def build_id() -> str:
    """The digest that names :func:`build_directory` (sources, flags, torch, Python, CPU): what a
    measurement of these kernels' speed depends on (:func:`triedec.api.calibration.device_key`)."""
    return build_directory().name.removeprefix("triedec-")


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
    """The compiled extension, built on first use (thread-safe; later calls return it at once).
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
            if not any(where.glob("*.so")):
                _log.warning("building triedec's kernels in %s (once per machine, ~1 min)", where)
            try:
                _module = cpp_extension.load(name=NAME, sources=[str(CSRC / name) for name in SOURCES],
                                             extra_cflags=list(CFLAGS), extra_include_paths=[str(CSRC)],
                                             build_directory=str(where), verbose=verbose)
            except Exception as exc:  # compiler missing or failing: say so once, keep the reason
                _failure = (f"triedec's kernels could not be built ({type(exc).__name__}: "
                            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
                            "run scripts/setup.sh (it installs a C++ compiler)")
                raise TriedecError(_failure) from exc
    return _module


def kernel_available() -> bool:
    """Whether the extension is built or can be built here (builds it if needed)."""
    try:
        load_kernel()
    except TriedecError:
        return False
    return True

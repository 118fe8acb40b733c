"""triedec's compiled kernels (``csrc/``): the fixed-order tree attention
(:mod:`triedec.model.attention`), the row-wise RMS norm (:mod:`triedec.model.rmsnorm`), the linears on
8-bit activations (:mod:`triedec.model.precision`) and the native forward (:mod:`triedec.model.runner`).

Two parts, built when the package is installed (``setup.py``, :mod:`triedec.model.isa`): the kernel
files, once per instruction set, each a library of its own; and one C++ extension, for every CPU,
that checks tensors and calls the kernels of the library it loaded. :func:`load_kernel` imports the
extension and loads into it the library of the fastest ISA this CPU runs. Where no installed build
matches the sources beside it (installed without torch in the build environment, or the sources
edited since), both are built on first use with ``torch.utils.cpp_extension``, the library for this
CPU (``-march=native``; about a minute with the C++ compiler), and cached under ``kernels/`` in
triedec's cache (:func:`triedec.core.paths.cache_root`, ``~/.cache/triedec`` by default), with a
warning that says why. Pure torch: nothing here knows transformers.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
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
from triedec.model.isa import (
    COMMON_FLAGS,
    CSRC,
    EXTENSION,
    EXTENSION_SOURCES,
    HEADERS,
    KERNEL_SOURCES,
    SOURCES,
    library_name,
    sources_digest,
    supported,
)

OPENMP = torch.backends.openmp.is_available() and sys.platform.startswith("linux")
"""Whether the kernels are built with OpenMP: where torch runs its own ops on GNU OpenMP (Linux
wheels); elsewhere (macOS' compiler takes no plain ``-fopenmp``) they run on the calling thread."""
CFLAGS = (*COMMON_FLAGS, "-march=native", *(("-fopenmp",) if OPENMP else ()))
"""The flags of a build made on first use. ``-march=native``: for the CPU it runs on (the build
directory names that CPU). ``-fopenmp``: ``at::parallel_for`` runs on torch's intra-op threads
(``torch.set_num_threads``) only when the including file is compiled with OpenMP; without it, it
runs the whole range on the calling thread. The symbols resolve to the OpenMP runtime torch itself
loaded, so there is one thread pool. ``parallel_threads()`` says how many threads a kernel's loop
gets. The installed builds use the same flags, the libraries with their ISA's instead of
``-march=native``, the extension with neither."""
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
    built on first use: ``<cache>/kernels/triedec-<hash>`` under :func:`triedec.core.paths.cache_root`."""
    digest = hashlib.sha256()
    parts = [(CSRC / name).read_bytes() for name in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(CFLAGS).encode(), torch.__version__.encode(), sys.version.encode(),
                 platform.machine().encode(), _cpu_name().encode()):
        digest.update(part)
        digest.update(b"\0")
    return cache_root() / "kernels" / f"triedec-{digest.hexdigest()[:16]}"


def build_id() -> str:
    """What a measurement of these kernels' speed depends on (:func:`triedec.api.calibration.device_key`):
    the loaded library's ISA and sources with torch, Python and the CPU for an installed build, the
    name of :func:`build_directory` for one built on first use."""
    module = load_kernel()
    if _is_installed(module):
        digest = hashlib.sha256("\0".join((module.isa(), module.sources_digest(), torch.__version__, sys.version,
                                           platform.machine(), _cpu_name())).encode())
        return f"{module.isa()}-{digest.hexdigest()[:12]}"
    return build_directory().name.removeprefix("triedec-")


def installed_libraries() -> dict[str, Path]:
    """The installed kernel library of each ISA this CPU runs, fastest first (whatever sources
    they were built from: :meth:`use_kernels` checks that)."""
    found = {}
    for isa in supported():
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            path = Path(__file__).parent / f"{library_name(isa)}{suffix}"
            if path.is_file():
                found[isa] = path
                break
    return found


def _is_installed(module: ModuleType) -> bool:
    """Whether ``module`` is the installed extension (not one built on first use)."""
    return getattr(module, "__name__", "") == f"triedec.model.{EXTENSION}"


def switchable_libraries() -> dict[str, Path]:
    """The kernel libraries the loaded extension can run (its ``use_kernels``), fastest first: the
    installed one of each ISA this CPU runs when the installed extension is loaded; none for a
    build made on first use (its one library is for this CPU)."""
    return installed_libraries() if _is_installed(load_kernel()) else {}


def installed_build() -> tuple[ModuleType | None, str]:
    """The installed extension, with the fastest installed kernel library this CPU runs loaded
    into it, when both were built from the sources beside them; else None with the reason."""
    try:
        module = importlib.import_module(f"triedec.model.{EXTENSION}")
    except ImportError as exc:
        return None, f"the extension is not installed ({exc})"
    if module.sources_digest() != sources_digest():
        return None, "the extension was built from other sources (edited since install?)"
    reasons = []
    libraries = installed_libraries()
    for isa in supported():
        if isa not in libraries:
            reasons.append(f"{isa}: not installed")
            continue
        try:
            module.use_kernels(str(libraries[isa]))
        except RuntimeError as exc:
            reasons.append(f"{isa}: {str(exc).splitlines()[0]}")
            continue
        return module, ""
    return None, "; ".join(reasons) or "no build for this CPU"


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
    """The compiled extension: the installed build for this CPU, else one built now (module doc;
    thread-safe; later calls return it at once). Raises :class:`TriedecError` with the compiler's
    reason when it cannot be built."""
    global _module, _failure
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            if _failure is not None:
                raise TriedecError(_failure)
            _module, why = installed_build()
            if _module is None:
                _module = _build_now(why, verbose)
    return _module


def _build_now(why: str, verbose: bool) -> ModuleType:
    """Build the extension for this CPU into :func:`build_directory` (or load it from there)."""
    global _failure
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    where = build_directory()
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not any(where.rglob("*.so")):
        _log.warning("no installed build of triedec's kernels fits (%s): building them in %s (~1 min); "
                     "reinstall triedec (scripts/setup.sh) to build them at install", why, where)
    # ninja runs the compiler through a shell, which would strip bare quotes: the macro must stay a string
    digest = f'-DTRIEDEC_SOURCES_DIGEST=\\"{sources_digest()}\\"'
    library, extension = where / "kernels", where / "extension"
    library.mkdir(exist_ok=True, mode=0o700)
    extension.mkdir(exist_ok=True, mode=0o700)
    try:
        path = cpp_extension.load(name=f"{NAME}_native", sources=[str(CSRC / name) for name in KERNEL_SOURCES],
                                  extra_cflags=[*CFLAGS, digest], extra_include_paths=[str(CSRC)],
                                  build_directory=str(library), verbose=verbose, is_python_module=False)
        module = cpp_extension.load(name=NAME, sources=[str(CSRC / name) for name in EXTENSION_SOURCES],
                                    extra_cflags=[*CFLAGS, digest], extra_include_paths=[str(CSRC)],
                                    extra_ldflags=["-ldl"], build_directory=str(extension), verbose=verbose)
        module.use_kernels(str(path))
        return module
    except Exception as exc:  # compiler missing or failing: say so once, keep the reason
        _failure = (f"triedec's kernels could not be built ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
                    "run scripts/setup.sh (it installs a C++ compiler)")
        raise TriedecError(_failure) from exc


def kernel_available() -> bool:
    """Whether the extension is installed or can be built here (builds it if needed)."""
    try:
        load_kernel()
    except TriedecError:
        return False
    return True

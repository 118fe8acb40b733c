"""Which builds of triedec's kernels exist and which one this CPU runs. The kernel files are
compiled once per instruction set (ISA), each into a library of its own, and the extension that
binds them to torch tensors once, for every CPU; both are made when the package is installed
(``setup.py``), and the extension runs the library of the fastest ISA this CPU runs, chosen at run
time (:func:`supported`, :mod:`triedec.model.native`). Torch-free, so that ``setup.py`` reads these
declarations as they are.

Every build computes the same bits: each kernel's vector path and its portable path perform the
same IEEE operations per element in the same order (``-ffp-contract=off``), so the ISA decides
only the speed (docs/kernels.md)."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
KERNEL_SOURCES = ("tree_attention.cpp", "rms_norm.cpp", "rotary.cpp", "a8_linears.cpp", "f32_linears.cpp",
                  "elementwise.cpp", "probes.cpp",
                  "table.cpp")
"""A kernel library's translation units, in ``csrc/``: the kernels (``kernels.h``: plain pointers,
no torch headers, quick to compile once per ISA) and the table of them it exports
(``kernel_table.h``)."""
EXTENSION_SOURCES = ("ops.cpp", "decoder.cpp", "bindings.cpp")
"""The extension's: the operations on tensors that check, allocate and call the kernels through the
loaded library's table (``ops.h``, ``ops.cpp``), the native forward (``decoder.h``, ``decoder.cpp``)
and the Python bindings of those. Built once: torch's headers make them most of the build's time."""
SOURCES = (*KERNEL_SOURCES, *EXTENSION_SOURCES)
EXTENSION = "_kernels"
"""The extension's module, inside this package: ``triedec.model._kernels``."""
HEADERS = ("kernels.h", "kernel_table.h", "tiles.h", "ops.h", "decoder.h",
           *(f"x86/{isa}/{op}.h" for isa in ("avx512", "avx2") for op in ("a8_linears", "tree_attention",
                                                                        "f32_linears", "probes")),
           "x86/amx/a8_linears.h")
"""The headers: the kernels' interfaces and, in ``x86/avx512/`` and ``x86/avx2/``, each op's code for
that instruction set (included by the op's translation unit where the build's flags enable it; the
portable code stays in the ``.cpp`` as the reference)."""
COMMON_FLAGS = ("-O3", "-g0", "-ffp-contract=off", "-fno-fast-math")
"""``-ffp-contract=off``: no implicit fused multiply-adds (an element gets the same bits in a vector
lane as in a scalar tail); the kernels' own fused ones are explicit. ``-g0`` overrides the ``-g``
Python's own build flags add: debug information for torch's headers costs a third of the build."""

ISAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "avx512amx": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                   "-mf16c", "-mamx-tile", "-mamx-int8"),
                  ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c", "amx_tile",
                   "amx_int8")),
    "avx512vnni": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma",
                    "-mf16c"),
                   ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c")),
    "avxvnni": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avxvnni_evex": (("-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mavx512vl", "-DTRIEDEC_VNNI256_EVEX"),
                     ("avx2", "fma", "f16c", "avx512_vnni", "avx512vl")),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
    "portable": ((), ()),
}
"""Each build: its compiler flags and the CPU flags (``/proc/cpuinfo``) it needs, fastest first.
``avx512amx`` is ``avx512vnni``'s code with the 8-bit linears' calls of 16 rows or more on
AMX-INT8's tile unit (``csrc/x86/amx/a8_linears.h``; the VNNI tiles where Linux does not grant the
process the tile state); ``avx512vnni`` runs the 8-bit-activation linears' VNNI path and tree
attention's AVX-512 path; ``avxvnni``
(AVX2 CPUs with AVX-VNNI: Intel's since Alder Lake, AMD's Zen 5) the linears' AVX2 tiles with the
256-bit ``vpdpbusd`` in its VEX encoding; ``avx2`` the linears' AVX2 path (``vpmaddubsw``) and tree
attention's; ``portable`` plain C++ everywhere. ``avxvnni_evex`` is ``avxvnni``'s code with the EVEX
encoding of the same instruction (AVX512-VNNI + VL): never the fastest where it runs, it exists so
that the CPUs with AVX-512, which lack AVX-VNNI's encoding (Zen 4), run and test the path an
AVX-VNNI CPU takes (``tests/test_native_kernels.py``: every installed build gives the same bits)."""


def library_name(isa: str) -> str:
    """The kernel library of ``isa``, inside this package: ``triedec/model/_isa_<isa>`` plus
    Python's extension suffix (a shared library, not a module to import)."""
    return f"_isa_{isa}"


def buildable() -> tuple[str, ...]:
    """The builds this machine's compiler target takes: all of them on x86-64, ``portable`` elsewhere."""
    return tuple(ISAS) if platform.machine().lower() in ("x86_64", "amd64") else ("portable",)


def compiler_accepts(flags: tuple[str, ...], compiler: str | None = None) -> bool:
    """Whether the C++ compiler (``compiler``, else ``$CXX``, else ``c++``) compiles an empty
    program with ``flags``: ``setup.py`` builds only the ISAs whose flags it takes, so an older
    compiler without, say, ``-mamx-int8`` (GCC before 11) installs the other builds instead of
    failing. True where no such compiler is found (the build then fails with the compiler's own
    error)."""
    import os
    import shutil
    import subprocess
    import tempfile

    command = compiler or os.environ.get("CXX") or "c++"
    if shutil.which(command) is None:
        return True
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "probe.cpp"
        source.write_text("int main() { return 0; }\n")
        done = subprocess.run([command, *flags, "-c", str(source), "-o", str(Path(scratch) / "probe.o")],
                              capture_output=True, check=False)
    return done.returncode == 0


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The builds this CPU can run, fastest first (``portable`` always)."""
    have = cpu_flags() if flags is None else flags
    return tuple(isa for isa in buildable() if set(ISAS[isa][1]) <= have)


def sources_digest() -> str:
    """A digest of the kernels' sources and common flags: what a build was made from. A build
    whose digest differs from the sources beside it is stale (the sources changed since install)."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((CSRC / name).read_bytes())
        digest.update(b"\0")
    digest.update(" ".join(COMMON_FLAGS).encode())
    return digest.hexdigest()[:16]

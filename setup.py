"""Builds triedec's C++ kernels when the package is installed: the kernel files once per instruction
set, each into a library of its own, and the extension that binds them to torch once, for every CPU
(src/triedec/model/isa.py declares them); the fastest library this CPU runs is chosen at run time, so
the first ``generate`` compiles nothing. torch's extension build needs torch in the environment that
builds: install torch first and this package with ``--no-build-isolation`` (scripts/setup.sh does).
Without torch there (an isolated build) the package installs without them, and they are built on
first use instead (triedec.model.native)."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("triedec_isa", HERE / "src" / "triedec" / "model" / "isa.py")
isa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(isa)

ext_modules, cmdclass = [], {}
try:
    import torch  # noqa: F401
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    print("triedec: torch is not importable here; the kernels will be built on first use", file=sys.stderr)
else:
    openmp = sys.platform.startswith("linux")
    digest = isa.sources_digest()
    csrc = Path("src") / "triedec" / "model" / "csrc"
    # -fopenmp compiles at::parallel_for onto OpenMP; not linked: its symbols bind to the runtime
    # torch loaded, one thread pool (triedec.model.native)
    common = [*isa.COMMON_FLAGS, *(["-fopenmp"] if openmp else [])]
    digest_macro = ("TRIEDEC_SOURCES_DIGEST", f'"{digest}"')
    ext_modules.append(CppExtension(
        f"triedec.model.{isa.EXTENSION}", [str(csrc / s) for s in isa.EXTENSION_SOURCES],
        include_dirs=[str(HERE / csrc)], define_macros=[digest_macro], libraries=["dl"],
        extra_compile_args=common))
    for name in isa.buildable():  # shared libraries the extension loads (no Python module in them)
        flags, _ = isa.ISAS[name]
        if not isa.compiler_accepts(flags):
            print(f"triedec: the C++ compiler does not take {' '.join(flags)}: no {name} build "
                  "(the fastest build it makes runs instead)", file=sys.stderr)
            continue
        ext_modules.append(CppExtension(
            f"triedec.model.{isa.library_name(name)}", [str(csrc / s) for s in isa.KERNEL_SOURCES],
            include_dirs=[str(HERE / csrc)], define_macros=[digest_macro, ("TRIEDEC_ISA", f'"{name}"')],
            extra_compile_args=[*common, *flags]))
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)

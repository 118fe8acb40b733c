"""Builds triedec's C++ kernels when the package is installed: one extension per instruction set
(src/triedec/model/isa.py declares them), the fastest one this CPU runs chosen at run time, so the
first ``generate`` compiles nothing. torch's extension build needs torch in the environment that
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
    for name in isa.buildable():
        flags, _ = isa.ISAS[name]
        ext_modules.append(CppExtension(
            f"triedec.model.{isa.module_name(name)}", [str(csrc / s) for s in isa.SOURCES],
            include_dirs=[str(HERE / csrc)],
            define_macros=[("TRIEDEC_SOURCES_DIGEST", f'"{digest}"'), ("TRIEDEC_ISA", f'"{name}"')],
            # -fopenmp compiles at::parallel_for onto OpenMP; not linked: its symbols bind to the
            # runtime torch loaded, one thread pool (triedec.model.native)
            extra_compile_args=[*isa.COMMON_FLAGS, *flags, *(["-fopenmp"] if openmp else [])]))
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)

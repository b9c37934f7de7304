"""Builds fusedmlp's two extensions: fusedmlp._C, the C kernels as static libraries (each
with its own C flags) under the thin C++ torch layer that registers the ops and their CPU
kernels, with no CUDA dependency; and fusedmlp._C_cuda, the CUDA kernels, when a CUDA build
is possible. Python loads _C_cuda only under a CUDA build of torch (fusedmlp/_extension.py),
so a wheel whose CUDA module does not load still runs on the CPU.

FUSEDMLP_CUDA=1 requires the CUDA build, FUSEDMLP_CUDA=0 skips it; unset, CUDA is built
when torch is a CUDA build, nvcc of torch's CUDA major version is found and cuBLASLt is
(in the toolkit or torch's nvidia-cublas wheel), else the build says why it builds the CPU
kernels only. TORCH_CUDA_ARCH_LIST overrides the default architectures (Ampere and Hopper).

The build writes fusedmlp/_build.json beside the extensions: the torch it was built
against, whether _C_cuda was built and why not, so that `import fusedmlp` can say what a
mismatch is and how to fix it.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"
# The stable ABI version the torch layer targets: torch 2.10 (csrc/stable/version.h's
# TORCH_VERSION_2_10_0, major << 56 | minor << 48).
TORCH_TARGET_VERSION = "0x020A000000000000"


def find_cuda_home() -> str | None:
    """The CUDA toolkit root: the one holding nvcc and cuda_runtime.h."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for home in candidates:
        if (
            home
            and (Path(home) / "bin" / "nvcc").exists()
            and (Path(home) / "include" / "cuda_runtime.h").exists()
        ):
            return home
    return None


# torch.utils.cpp_extension reads CUDA_HOME when imported.
CUDA_HOME = find_cuda_home()
if CUDA_HOME:
    os.environ["CUDA_HOME"] = CUDA_HOME
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def nvcc_version() -> str | None:
    """The toolkit's CUDA version ("13.0"), from nvcc."""
    out = subprocess.run(
        [str(Path(CUDA_HOME) / "bin" / "nvcc"), "--version"], capture_output=True, text=True
    ).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


def cublaslt_location() -> tuple[str, str, list[str]] | None:
    """(include dir, library dir, library files) of cuBLASLt and cuBLAS: the toolkit's, or
    the nvidia-cublas wheel torch depends on (found on sys.path, which holds the isolated
    build environment's packages too); None if neither has them."""
    roots = [Path(CUDA_HOME)] if CUDA_HOME else []
    for entry in sys.path:
        roots += [Path(p) for p in glob.glob(os.path.join(entry, "nvidia", "*"))]
    for root in roots:
        headers = root / "include" / "cublasLt.h"
        for lib_dir in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
            lt = sorted(glob.glob(str(lib_dir / "libcublasLt.so*")))
            blas = sorted(glob.glob(str(lib_dir / "libcublas.so*")))
            if headers.exists() and lt and blas:
                return str(headers.parent), str(lib_dir), [Path(lt[0]).name, Path(blas[0]).name]
    return None


def cuda_unavailable_reason() -> str | None:
    """Why the CUDA kernels cannot be built against this torch here, or None if they can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None:
        return "nvcc and the CUDA toolkit (cuda_runtime.h) were not found; set CUDA_HOME"
    toolkit = nvcc_version()
    if toolkit is None or toolkit.split(".")[0] != torch.version.cuda.split(".")[0]:
        return (
            f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but the toolkit "
            f"at {CUDA_HOME} is CUDA {toolkit}: the major versions must match"
        )
    if cublaslt_location() is None:
        return "cuBLASLt and cuBLAS (cublasLt.h, libcublasLt.so, libcublas.so) were not found"
    return None


def cuda_build() -> tuple[bool, str | None]:
    """(whether to build fusedmlp._C_cuda, why not when it is not built)."""
    forced = os.environ.get("FUSEDMLP_CUDA")
    if forced == "0":
        print("fusedmlp: FUSEDMLP_CUDA=0, building the CPU kernels only")
        return False, "it was built with FUSEDMLP_CUDA=0"
    reason = cuda_unavailable_reason()
    if reason is None:
        return True, None
    if forced == "1":
        sys.exit(f"fusedmlp: FUSEDMLP_CUDA=1 but the CUDA kernels cannot be built: {reason}")
    print(f"fusedmlp: building the CPU kernels only: {reason}")
    return False, reason


def target_architecture() -> str:
    """This machine's architecture as the registry's features tell ISAs apart."""
    machine = platform.machine().lower()
    return {"x86_64": "x86", "amd64": "x86", "i386": "x86", "i686": "x86", "arm64": "aarch64"}.get(
        machine, machine
    )


def isa_architecture(features: str) -> str | None:
    """The architecture of an ISA from the features its registry entry names (None: any)."""
    if "FMLP_ARM_FEATURE(" in features:
        return "aarch64"
    return "x86" if "FMLP_FEATURE(" in features else None


def cpu_isa_registry() -> tuple[dict[str, list[str]], dict[str, str], set[str]]:
    """The registry csrc/include/fusedmlp/cpu_isas.def, read without a C compiler: each
    ISA's name -> compiler flags and each kernel unit's source -> its ISA's name, for the
    ISAs of this machine's architecture (api.c dispatches to those only), and every unit's
    source."""
    text = (ROOT / "csrc" / "include" / "fusedmlp" / "cpu_isas.def").read_text()
    isas = re.findall(r'^FMLP_ISA\((\w+), (\w+), "([^"]*)",(.*)\)$', text, re.MULTILINE)
    here = {
        isa_id: (name, isa_flags.split())
        for isa_id, name, isa_flags, features in isas
        if isa_architecture(features) in (None, target_architecture())
    }
    units = re.findall(r"^FMLP_KERNELS\(\w+, (\w+), (\w+)\)", text, re.MULTILINE)
    # an ISA may have a unit per dtype: keyed by source
    sources = {f"csrc/cpu/kernels_{suffix}.c": isa_id for isa_id, suffix in units}
    return (
        dict(here.values()),
        {source: here[isa_id][0] for source, isa_id in sources.items() if isa_id in here},
        set(sources),
    )


# The kernel units of each instruction set are built into their own static
# library with that ISA's flags; everything else (API, ISA choice, the
# units built without flags) is built for any CPU of the architecture. Units
# of another architecture's ISAs are not built. The API picks an ISA at run
# time from CPUID (x86) or HWCAP (aarch64). The CUDA path's plain-C decisions
# make one more library.
def kernel_libraries() -> list[tuple[str, dict]]:
    cpu_dir = ROOT / "csrc" / "cpu"
    isa_flags, unit_isas, all_units = cpu_isa_registry()
    isa_sources = {source: isa for source, isa in unit_isas.items() if isa_flags[isa]}
    shared = [str(p.relative_to(ROOT)) for p in cpu_dir.glob("*.c")]
    flagless_units = [source for source in unit_isas if source not in isa_sources]
    portable = sorted([source for source in shared if source not in all_units] + flagless_units)
    flags = ["-std=c11", "-O3", "-fPIC", "-Wall", "-Wextra", "-Wpointer-arith", "-fno-math-errno"]
    # obj_deps: every kernel includes the templates and headers, which
    # build_clib would otherwise not know to recompile for.
    headers = sorted(
        str(p.relative_to(ROOT))
        for p in [
            *cpu_dir.glob("*.h"),
            *(ROOT / "csrc" / "include" / "fusedmlp").glob("*.h"),
            *(ROOT / "csrc" / "include" / "fusedmlp").glob("*.def"),
        ]
    )
    common = {"include_dirs": ["csrc/include", "csrc/cpu"], "obj_deps": {"": headers}}
    # The portable library comes first: the linker resolves its references to
    # the ISA libraries that follow it.
    libraries = [("fusedmlp_cpu_kernels", {**common, "sources": portable, "cflags": flags})]
    for isa, extra_flags in isa_flags.items():
        sources = sorted(source for source, unit_isa in isa_sources.items() if unit_isa == isa)
        if sources:
            libraries.append(
                (
                    f"fusedmlp_cpu_kernels_{isa}",
                    {**common, "sources": sources, "cflags": flags + extra_flags},
                )
            )
    # The CUDA path's decisions (csrc/cuda/routing.c) are plain C: built here with the
    # same flags, linked by the CUDA build, and compiled by tests/c on any machine.
    libraries.append(
        (
            "fusedmlp_cuda_routing",
            {**common, "sources": ["csrc/cuda/routing.c"], "cflags": flags},
        )
    )
    return libraries


def kernel_files() -> list[str]:
    """The C kernels' sources and headers: the extension relinks when they change, since
    build_ext does not look at the static libraries themselves."""
    paths = [
        *(ROOT / "csrc" / "cpu").glob("*"),
        *(ROOT / "csrc" / "include").rglob("*"),
        ROOT / "csrc" / "cuda" / "routing.c",
    ]
    return sorted(str(p.relative_to(ROOT)) for p in paths if p.suffix in (".c", ".h", ".def"))


def extensions(with_cuda: bool) -> list:
    """fusedmlp._C (the schemas and the CPU kernels, linked to no CUDA library) and,
    with CUDA, fusedmlp._C_cuda (the CUDA kernels, registered when Python loads it).
    Both use only CPython's limited API (torch's BuildExtension defines Py_LIMITED_API
    for 3.10 and links no libtorch_python), so they are abi3 modules that any CPython from
    3.10 on loads."""
    include_dirs = [str(ROOT / "csrc" / "include")]
    # torch adds the C++ standard it was built with. _C is compiled against LibTorch's
    # stable ABI of torch 2.10 (the oldest supported), so that it loads under every torch
    # from 2.10 on; with TORCH_TARGET_VERSION defined, torch's headers refuse to be included
    # unless they are stable. _C_cuda also uses torch's CUDA context (cuBLASLt handle and
    # workspace), which only the regular headers give: it is tied to its torch.
    cxx_flags = ["-O2", f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
    modules = [
        CppExtension(
            "fusedmlp._C",
            [
                "csrc/torch/schemas.cpp",
                "csrc/torch/arguments.cpp",
                "csrc/torch/cpu.cpp",
                "csrc/torch/weight_cache.cpp",
            ],
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            depends=kernel_files(),
            py_limited_api=True,
        )
    ]
    if not with_cuda:
        return modules
    include_dir, lib_dir, lib_files = cublaslt_location()
    print(f"fusedmlp: CUDA build for {os.environ['TORCH_CUDA_ARCH_LIST']}, cuBLASLt {lib_dir}")
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "cuda").glob("*.cu"))
    modules.append(
        CUDAExtension(
            "fusedmlp._C_cuda",
            ["csrc/torch/arguments.cpp", "csrc/torch/cuda.cpp", *cuda_sources],
            include_dirs=[*include_dirs, include_dir],
            library_dirs=[lib_dir],
            extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O3", f"-I{include_dir}"]},
            extra_link_args=[f"-l:{name}" for name in lib_files],
            depends=kernel_files(),
            py_limited_api=True,
        )
    )
    return modules


class BuildWithKernels(BuildExtension):
    """Builds the C kernel libraries before the extensions that link them, and records
    what the extensions were built against beside them (fusedmlp/_build.json)."""

    build_record: dict = {}

    def finalize_options(self) -> None:
        super().finalize_options()
        # Relink on every build: setuptools' timestamp check does not see which torch an
        # extension was built against, and would keep one built for another torch. torch's
        # BuildExtension does this itself when it builds with ninja (which recompiles only
        # the objects whose command or headers changed), but not without ninja.
        self.force = True

    def run(self) -> None:
        self.run_command("build_clib")
        super().run()
        package = Path(self.get_ext_fullpath("fusedmlp._C")).parent
        self.remove_other_builds(package)
        (package / "_build.json").write_text(json.dumps(self.build_record, indent=1) + "\n")

    def remove_other_builds(self, package: Path) -> None:
        """Deletes each extension's files of another suffix beside the one just built (an
        earlier _C.cpython-311-x86_64-linux-gnu.so beside _C.abi3.so): Python would import
        the version-specific one first, and a stale _C_cuda would be loaded for a CUDA
        module this build did not make."""
        built = {Path(self.get_ext_fullpath(ext.name)).name for ext in self.extensions}
        for name in ("_C", "_C_cuda"):
            for path in package.glob(f"{name}.*.so"):
                if path.name not in built:
                    path.unlink()


WITH_CUDA, NO_CUDA_REASON = cuda_build()
BuildWithKernels.build_record = {
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_module": WITH_CUDA,
    "no_cuda_reason": NO_CUDA_REASON,
    "source": str(ROOT),
}

setup(
    libraries=kernel_libraries(),
    ext_modules=extensions(WITH_CUDA),
    cmdclass={"build_ext": BuildWithKernels},
    # One wheel for every CPython from 3.10 on (the cp310-abi3 tag).
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)

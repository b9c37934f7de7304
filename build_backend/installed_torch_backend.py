"""setuptools' build backend, compiling against the torch of the environment being installed
into (pyproject.toml names it).

fusedmlp's extensions use torch's C++ ABI, which changes between torch releases, so they
must be compiled against the torch they will import. pip's build isolation would instead
install the newest torch (a CUDA build of several GB) into a temporary environment and
compile against that, giving an extension the installed torch cannot load. So when the
environment of this interpreter (where pip installs) or the activated virtual environment
(where `python -m build` runs from) holds torch, the build imports that torch, its
site-packages placed after the isolated environment's (setuptools and wheel still come from
the isolated environment). Only where no torch is installed is torch a build requirement.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403  (the hooks not wrapped below)

TORCH_REQUIREMENT = "torch>=2.10"  # as pyproject.toml's dependencies say


def installed_torch_site_dirs() -> list[str]:
    """The site-packages directories of the target environment that hold torch."""
    dirs = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        dirs += [str(Path(venv) / lib / version / "site-packages") for lib in ("lib", "lib64")]
    return [d for d in dict.fromkeys(dirs) if (Path(d) / "torch" / "__init__.py").exists()]


def torch_requirement() -> list[str]:
    return [] if installed_torch_site_dirs() else [TORCH_REQUIREMENT]


def with_installed_torch(hook: Callable[..., Any]) -> Callable[..., Any]:
    """The hook, run with the installed torch importable (setup.py imports torch)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        for site_dir in installed_torch_site_dirs():
            if site_dir not in sys.path:
                sys.path.append(site_dir)
        return hook(*args, **kwargs)

    return run


# setuptools' own get_requires hooks would run setup.py, which imports torch, to read its
# setup_requires (it has none); pyproject.toml's requires are installed anyway.
def get_requires_for_build_wheel(config_settings: Any = None) -> list[str]:
    return torch_requirement()


def get_requires_for_build_sdist(config_settings: Any = None) -> list[str]:
    return torch_requirement()


def get_requires_for_build_editable(config_settings: Any = None) -> list[str]:
    return torch_requirement()


build_wheel = with_installed_torch(build_meta.build_wheel)
build_sdist = with_installed_torch(build_meta.build_sdist)
build_editable = with_installed_torch(build_meta.build_editable)
prepare_metadata_for_build_wheel = with_installed_torch(
    build_meta.prepare_metadata_for_build_wheel
)
prepare_metadata_for_build_editable = with_installed_torch(
    build_meta.prepare_metadata_for_build_editable
)

"""The import machinery of the stand-ins (torch-free: imported by sitecustomize in every process).

- `sgl_kernel.<sub>` modules that the stand-in has no file for are made on import, and every name
  in them is a `Missing`: importing and naming it works, calling it raises with its name.
- Modules of SGLang that need the CuTe DSL (nvidia-cutlass-dsl, not carried) are replaced by the
  files in `standins/` that say the fused kernel is unavailable, so SGLang takes its plain path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

STANDINS = Path(__file__).parent / "standins"
REPLACED = {"sglang.kernels.ops.gemm.cutedsl_dual_gemm": STANDINS / "cutedsl_dual_gemm.py"}


class Missing:
    """An op (or a table of constants, `scalar_types.uint4b8`) the stand-in does not have."""

    def __init__(self, qualname: str):
        self.qualname = qualname
        self.__name__ = qualname.rsplit(".", 1)[-1]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self.qualname}.{name}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.qualname} is not in rltrain's test stand-in for sglang-kernel")

    def __repr__(self) -> str:
        return f"<missing {self.qualname}>"


class _Placeholder(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self.__name__}.{name}")


def _has_file(fullname: str) -> bool:
    """The stand-in's own submodules (sgl_kernel/utils.py) are imported as usual."""
    return (Path(__file__).parent / (fullname.replace(".", "/") + ".py")).is_file()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname in REPLACED:
            return importlib.util.spec_from_file_location(fullname, REPLACED[fullname])
        if fullname.startswith("sgl_kernel.") and not _has_file(fullname):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Placeholder(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

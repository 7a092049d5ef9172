"""Shim (tests only): just enough of torchvision for text-only imports; any real use raises.

Submodules that have no file here (torchvision.transforms.v2, ...) are made on import by a
finder; every name in them resolves to a stand-in that raises when called.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+rltrain-shim"


def __getattr__(name):
    from torchvision._unavailable import unavailable

    return unavailable(f"torchvision.{name}")


class _StubModuleLoader(importlib.abc.Loader):
    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # a package, so deeper submodules resolve too

        def __getattr__(name, _qual=spec.name):
            from torchvision._unavailable import unavailable

            return unavailable(f"{_qual}.{name}")

        mod.__getattr__ = __getattr__
        return mod

    def exec_module(self, module):
        pass


class _StubFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith("torchvision."):
            return None
        # Real files in this shim win; only missing submodules are stubbed.
        if importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubModuleLoader(), is_package=True)


sys.meta_path.append(_StubFinder())

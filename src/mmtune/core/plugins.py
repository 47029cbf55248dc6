"""How registries find their plugins: every module of the registry's package is imported once.

A plugin module (a model family, a data format, a benchmark) registers itself when imported,
so adding one is adding its module; no registry keeps a list of names. Each package is
imported once per process: the registries ask on every lookup.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

__all__ = ["import_package_modules"]

_IMPORTED: set[str] = set()


def import_package_modules(package: str, folder: str) -> None:
    """Import every module directly inside ``folder``, the directory of ``package``, once.

    The package counts as imported before its modules are: a plugin module that asks its
    registry while it is being imported (a family building a config) must not recurse.

    Args:
        package: the dotted package name (a registry passes its ``__package__``).
        folder: that package's directory (``Path(__file__).parent`` of the registry).
    """
    if package in _IMPORTED:
        return
    _IMPORTED.add(package)
    for info in pkgutil.iter_modules([str(Path(folder))]):
        importlib.import_module(f"{package}.{info.name}")

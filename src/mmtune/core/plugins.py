"""How registries find their plugins: every module of the registry's package is imported once.

A plugin module (a model family, a data format, a benchmark) registers itself when imported,
so adding one is adding its module; no registry keeps a list of names.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

__all__ = ["import_package_modules"]


def import_package_modules(package: str, folder: str) -> None:
    """Import every module directly inside ``folder``, the directory of ``package``.

    Args:
        package: the dotted package name (a registry passes its ``__package__``).
        folder: that package's directory (``Path(__file__).parent`` of the registry).
    """
    for info in pkgutil.iter_modules([str(Path(folder))]):
        importlib.import_module(f"{package}.{info.name}")

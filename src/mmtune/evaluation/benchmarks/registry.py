"""Name -> benchmark class: what the runner, the evaluate CLI, the viewer and ``mmtune plan`` ask.

A benchmark registers itself with :func:`register` when its module is imported. The
built-in benchmarks are the modules of this package: they are found and imported on
first use, so there is no list to keep. A benchmark outside the package (a plugin, a
test) registers by being imported before the config that names it is built.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from mmtune.core.plugins import import_package_modules

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.evaluation.benchmarks.base import Benchmark

__all__ = ["register", "registered_names", "get_benchmark", "benchmarks_for", "settings_classes"]

_REGISTRY: dict[str, type["Benchmark"]] = {}


def register(cls: type["Benchmark"]) -> type["Benchmark"]:
    """Class decorator: make ``cls`` available under ``cls.name``.

    Raises:
        ValueError: ``cls`` has no name or no ``settings_class``, or another class
            already holds the name.
    """
    problems = []
    if not cls.name:
        problems.append("set the class attribute `name` (the eval.<name> section and file names use it)")
    if getattr(cls, "settings_class", None) is None:
        problems.append("set `settings_class` to the dataclass of its eval.<name> settings")
    if problems:
        raise ValueError(f"benchmark class {cls.__module__}.{cls.__qualname__}: " + "; ".join(problems))
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"benchmark {cls.name!r} is registered twice ({other.__module__}.{other.__qualname__} and "
                         f"{cls.__module__}.{cls.__qualname__}); give one of them another name")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    """Import every module of this package once; the benchmark modules register themselves."""
    import_package_modules(__package__, str(Path(__file__).parent))


def registered_names() -> tuple[str, ...]:
    """Every registered benchmark, built-in ones first (in module order), then the others."""
    _discover()
    return tuple(_REGISTRY)


def get_benchmark(name: str) -> "Benchmark":
    """An instance of the benchmark registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown benchmark {name!r}; choose from {list(_REGISTRY)}")
    return _REGISTRY[name]()


def benchmarks_for(names: Iterable[str]) -> dict[str, "Benchmark"]:
    """``{name: benchmark}`` for those of ``names`` that are registered benchmarks (a result
    read back from a file names its benchmark; lmms-eval task names are not benchmarks)."""
    _discover()
    return {name: _REGISTRY[name]() for name in names if name in _REGISTRY}


def settings_classes() -> dict[str, type]:
    """``{name: settings dataclass}`` of every registered benchmark: the sections of ``eval``."""
    _discover()
    return {name: cls.settings_class for name, cls in _REGISTRY.items()}

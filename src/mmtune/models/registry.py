"""Name → adapter class. Adapters register themselves; :func:`build_adapter` imports the
known family modules on first use so a config only has to say ``family: llava``."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.models.base import ModelAdapter
    from mmtune.models.config import ModelConfig

_ADAPTERS: dict[str, type["ModelAdapter"]] = {}

# Family modules shipped with mmtune, imported lazily (each pulls in transformers).
_BUILTIN_MODULES = (
    "mmtune.models.llava",
    "mmtune.models.auto",
    "mmtune.models.internlm_xcomposer2",
    "mmtune.models.qwen2_vl",
)


def register_adapter(cls: type["ModelAdapter"]) -> type["ModelAdapter"]:
    """Class decorator: register an adapter under its ``family`` name."""
    if cls.family in _ADAPTERS and _ADAPTERS[cls.family] is not cls:
        raise ValueError(f"adapter family {cls.family!r} is registered twice ({_ADAPTERS[cls.family]} and {cls})")
    _ADAPTERS[cls.family] = cls
    return cls


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # a real missing dependency inside the module
                raise


def adapter_class(family: str) -> type["ModelAdapter"]:
    if family not in _ADAPTERS:
        _import_builtins()
    if family not in _ADAPTERS:
        raise KeyError(
            f"unknown model family {family!r}; known: {sorted(_ADAPTERS)}. "
            "Set `model.family` to one of them or register your adapter with @register_adapter."
        )
    return _ADAPTERS[family]


def build_adapter(config: "ModelConfig") -> "ModelAdapter":
    """The adapter of ``config.family``.

    Raises:
        FileNotFoundError: ``model.path`` is a local path that does not exist (named
            here, before transformers reports it as an unknown hub id).
        ValueError: the model config is invalid (every problem listed).
    """
    from mmtune.schema_keys import model_path_problem

    config.validate()
    problem = model_path_problem(config.path)
    if problem:
        raise FileNotFoundError(problem)
    return adapter_class(config.family)(config)

"""Distributed engines behind one seam: DDP, DeepSpeed ZeRO and PyTorch FSDP2.

``training.backend.engine`` names the engine; :func:`build_engine` makes it from the run's
config. Each engine is one class (:class:`~mmtune.training.engines.base.Engine`) in its own
module and registers itself here by name; nothing outside these modules branches on an
engine's name.

=========  ===================================================  ==============================
name       class                                                launch
=========  ===================================================  ==============================
ddp        :class:`~mmtune.training.engines.ddp.DDPEngine`       python / torchrun / accelerate
deepspeed  :class:`~mmtune.training.engines.deepspeed.DeepSpeedEngine`  accelerate launch (DeepSpeed config) or torchrun
fsdp2      :class:`~mmtune.training.engines.fsdp2.FSDP2Engine`   torchrun / accelerate (multi-GPU config)
=========  ===================================================  ==============================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mmtune.core.plugins import import_package_modules
from mmtune.training.engines.base import (_ENGINES, Engine, EngineContext, EngineLaunchError, StateMemory,  # noqa: F401
                                          launched_engine, register_engine)

__all__ = ["Engine", "EngineContext", "EngineLaunchError", "StateMemory", "build_engine", "engine_class",
           "engine_names", "launched_engine", "register_engine", "settings_classes"]


def _load_builtin() -> None:
    # Every module of this package registers its engine when imported (core/plugins, as the
    # families and formats); imported on first use: the modules import torch, the config module must not.
    import_package_modules(__package__, str(Path(__file__).parent))


def engine_names() -> list[str]:
    """Every registered engine name."""
    _load_builtin()
    return sorted(_ENGINES)


def settings_classes() -> dict[str, type]:
    """``{name: settings dataclass}`` of every registered engine: the sections of ``training.backend``."""
    _load_builtin()
    return {name: cls.settings_class for name, cls in sorted(_ENGINES.items())}


def engine_class(name: str) -> type[Engine]:
    """The engine class registered as ``name``.

    Raises:
        KeyError: no engine has that name (the message lists those that exist).
    """
    _load_builtin()
    if name not in _ENGINES:
        raise KeyError(f"training.backend.engine={name!r}: no such engine; use one of {', '.join(sorted(_ENGINES))}")
    return _ENGINES[name]


def build_engine(name: str, settings: Any, context: EngineContext = EngineContext()) -> Engine:
    """The engine registered as ``name`` with its ``training.backend.<name>`` section ``settings``
    and what it needs to know of the run (``context``)."""
    return engine_class(name)(settings, context)

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

from typing import TYPE_CHECKING, Callable

from mmtune.training.engines.base import _ENGINES, Engine, EngineLaunchError, StateMemory, launched_engine, register_engine  # noqa: F401

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.training.config import SFTConfig

__all__ = ["Engine", "EngineLaunchError", "StateMemory", "build_engine", "engine_class", "engine_names",
           "launched_engine", "register_engine", "settings_classes"]

def _load_builtin() -> None:
    # Imported on first use: the modules import torch, the config module must not.
    from mmtune.training.engines import ddp, deepspeed, fsdp2  # noqa: F401


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


def build_engine(cfg: "SFTConfig") -> Engine:
    """The engine ``cfg.training.backend.engine`` names, with its settings."""
    factory: Callable[["SFTConfig"], Engine] = engine_class(cfg.training.backend.engine)
    return factory(cfg)

"""PyTorch DistributedDataParallel through accelerate: full weights, gradients and optimizer on every rank.

One process needs no launcher and no wrapper (accelerate leaves the model as it is);
several are started by ``torchrun`` or ``accelerate launch`` and all-reduce gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mmtune.training.engines.base import Engine, StateMemory, adamw_bytes, register_engine

__all__ = ["DDPEngine", "DDPEngineConfig"]


@dataclass
class DDPEngineConfig:
    """``training.backend.ddp``: PyTorch DistributedDataParallel, full weights on every rank."""

    find_unused_parameters: Optional[bool] = None
    """DDP's unused-parameter search. ``None``: on when the vision tower trains (LLaVA reads
    the penultimate CLIP layer, so the last one gets no gradient), off otherwise (faster)."""


@register_engine
class DDPEngine(Engine):
    """Data parallel with replicated state (``training.backend.engine=ddp``, the default)."""

    name = "ddp"
    settings_class = DDPEngineConfig
    sequence_parallel_problem = ""

    def accelerator_kwargs(self) -> dict[str, Any]:
        from accelerate.utils import DistributedDataParallelKwargs

        find_unused = self.config.find_unused_parameters
        if find_unused is None:
            find_unused = self.context.trains_vision
        return {**super().accelerator_kwargs(),
                "kwargs_handlers": [DistributedDataParallelKwargs(find_unused_parameters=find_unused)]}

    @classmethod
    def state_memory(cls, config: Any, *, total: int, trainable: int, weight_bytes: int,
                     num_gpus: int, num_layers: int = 1, root_params: int = 0) -> StateMemory:
        return StateMemory(weights=float(weight_bytes * total), gradients=float(weight_bytes * trainable),
                           optimizer=adamw_bytes(trainable, weight_bytes))

    @classmethod
    def describe(cls, config: Any) -> str:
        return "DDP (weights, gradients and AdamW states replicated on every GPU)"

"""DeepSpeed ZeRO (stage 2 or 3, optional CPU offload) through accelerate.

The only module of the training core that imports DeepSpeed or knows its conventions:
the plugin and its ``"auto"`` values, the engine's own step and clipping inside
``backward``, ZeRO-3's partitioned parameters (``ds_id`` / ``ds_numel`` / gathering
around a read of the output head), its sharded checkpoint and the gathered ``final/``.

Launch: ``accelerate launch --config_file launch/accelerate/*zero*.yaml`` (accelerate builds
the plugin from the file; its stage must equal ``training.backend.deepspeed.stage``), or
any plain launch (``python``, ``torchrun``), where this engine builds the plugin from
``training.backend.deepspeed``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

from mmtune.training.engines.base import (Engine, EngineContext, EngineLaunchError, StateMemory, adamw_bytes,
                                          computing_twin, launched_engine, register_engine)

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator
    from torch import nn

__all__ = ["DeepSpeedEngine", "DeepSpeedEngineConfig", "ZERO3_LIVE_PARAMETERS"]

ZERO3_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's ``stage3_max_live_parameters`` default: parameters gathered at once under ZeRO-3."""


def read_ds_json(path: str) -> dict[str, Any]:
    """A DeepSpeed JSON config as a dict: the one place mmtune parses DeepSpeed's file."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _offload_device(zero: dict[str, Any], key: str) -> bool:
    return str((zero.get(key) or {}).get("device", "none")) not in ("none", "None")


@dataclass
class DeepSpeedEngineConfig:
    """``training.backend.deepspeed``: DeepSpeed ZeRO through accelerate."""

    stage: int = 3
    """ZeRO stage: 2 shards optimizer states and gradients, 3 the weights too (less memory
    per GPU, one all-gather per layer and step)."""
    offload_optimizer: bool = False
    """Keep optimizer states (and their step) in CPU memory: frees 12 bytes per trained
    parameter on the GPU, the step runs on the CPU."""
    offload_params: bool = False
    """ZeRO-3 only: keep the weights' shards in CPU memory between uses."""
    config_file: Optional[str] = None
    """A DeepSpeed JSON with tuning values (bucket sizes, prefetch); its
    ``zero_optimization.stage`` must equal ``stage``. ``None``: DeepSpeed's defaults.
    Batch size, accumulation, clipping and precision always come from this config."""


@register_engine
class DeepSpeedEngine(Engine):
    """ZeRO-2/3 (``training.backend.engine=deepspeed``)."""

    name = "deepspeed"
    settings_class = DeepSpeedEngineConfig
    package = "deepspeed"
    sequence_parallel_problem = (
        "not known to be wrong, but never run: DeepSpeed trains several processes only through deepspeed.comm, "
        "which hangs on CPU (gloo) ranks, so the check that losses and gradients equal one process's (passed under "
        "ddp and fsdp2 on 2 and 4 ranks) has not run under it, in particular ZeRO's gradient reduction overlapping "
        "the Ulysses all-to-all in the backward, and ZeRO-3 gathering the vision tower's weights while each rank of "
        "a group encodes its own share of the images")
    launch_hint = "accelerate launch --config_file launch/accelerate/single_node_8gpu_zero3.yaml recipes/sft.py"

    # -- start-up --------------------------------------------------------------------------
    @classmethod
    def config_problems(cls, config: Any, context: EngineContext) -> list[str]:
        problems = super().config_problems(config, context)
        c = config
        if c.stage not in (1, 2, 3):
            problems.append(f"training.backend.deepspeed.stage={c.stage}: use 1, 2 or 3")
        if c.offload_params and c.stage != 3:
            problems.append(f"training.backend.deepspeed.offload_params=true needs stage 3 (stage={c.stage}): "
                            "only ZeRO-3 partitions the weights")
        if c.config_file is not None:
            if not os.path.isfile(c.config_file):
                problems.append(f"training.backend.deepspeed.config_file={c.config_file!r} does not exist")
            else:
                problems += cls._file_problems(c, read_ds_json(c.config_file), c.config_file)
        return problems

    @staticmethod
    def _file_problems(c: Any, ds: dict[str, Any], origin: str) -> list[str]:
        """Where a DeepSpeed JSON disagrees with ``training.backend.deepspeed`` (both values named)."""
        zero = ds.get("zero_optimization", {})
        found = {"stage": int(zero.get("stage", 0)), "offload_optimizer": _offload_device(zero, "offload_optimizer"),
                 "offload_params": _offload_device(zero, "offload_param")}
        return [f"training.backend.deepspeed.{key}={getattr(c, key)!r} but {origin} has {value!r}: make them "
                "agree (the config decides; the launch file must match it)"
                for key, value in found.items() if getattr(c, key) != value]

    @classmethod
    def launch_config_problem(cls, config: Any, launch: dict[str, Any], origin: str,
                              resolve: Callable[[str], str] = str) -> str:
        """Also: the ZeRO stage and offloads the launch file starts (inline, or in the DeepSpeed JSON it
        names) against ``training.backend.deepspeed``, as :meth:`start` checks them."""
        problem = super().launch_config_problem(config, launch, origin, resolve)
        ds = launch.get("deepspeed_config") or {}
        if problem or not ds:
            return problem
        if ds.get("deepspeed_config_file"):
            path = ds["deepspeed_config_file"]
            zero = read_ds_json(resolve(path)).get("zero_optimization", {})
            origin = f"{origin} -> {path}"
        else:
            zero = {"stage": ds.get("zero_stage", 0),
                    "offload_optimizer": {"device": ds.get("offload_optimizer_device") or "none"},
                    "offload_param": {"device": ds.get("offload_param_device") or "none"}}
        stage = int(zero.get("stage", 0))
        if stage != config.stage:
            return (f"training.backend.deepspeed.stage={config.stage} but {origin} launches ZeRO-{stage}: make them "
                    "agree (the config decides; the launch file must match it)")
        return "\n".join(cls._file_problems(config, {"zero_optimization": zero}, origin))

    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed config this engine runs with when it builds the plugin itself."""
        c = self.config
        ds: dict[str, Any] = read_ds_json(c.config_file) if c.config_file else {}
        zero = ds.setdefault("zero_optimization", {})
        zero["stage"] = c.stage
        if c.offload_optimizer:
            zero.setdefault("offload_optimizer", {"device": "cpu", "pin_memory": True})
        if c.offload_params:
            zero.setdefault("offload_param", {"device": "cpu", "pin_memory": True})
        if c.stage == 3:
            zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
        for key in ("gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                    "train_micro_batch_size_per_gpu"):
            ds.setdefault(key, "auto")
        ds.setdefault("bf16", {"enabled": "auto"})
        ds.setdefault("fp16", {"enabled": "auto"})
        ds.setdefault("steps_per_print", 1_000_000)
        return ds

    def accelerator_kwargs(self) -> dict[str, Any]:
        if launched_engine() == self.name:  # accelerate builds the plugin from its launch config
            return {"cpu": False}
        from accelerate.utils import DeepSpeedPlugin

        return {"cpu": False, "deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=self.ds_config())}

    def start(self, accelerator: "Accelerator") -> None:
        super().start(accelerator)
        plugin = accelerator.state.deepspeed_plugin
        if plugin is None:
            raise EngineLaunchError("training.backend.engine=deepspeed but accelerate started no DeepSpeed engine")
        ds = plugin.deepspeed_config
        problems = self._file_problems(self.config, ds, "the launch's DeepSpeed config")
        if problems:
            raise EngineLaunchError("\n".join(problems))
        # Our batches vary in size (token budgets, packing), so the micro-batch size DeepSpeed
        # wants is nominal: 1 "batch" per forward. Clipping comes from our config.
        if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            ds["train_micro_batch_size_per_gpu"] = 1
        if ds.get("gradient_clipping", "auto") == "auto":
            ds["gradient_clipping"] = float(self.context.max_grad_norm or 0.0)

    @property
    def stage(self) -> int:
        return int(self.config.stage)

    @contextlib.contextmanager
    def evaluation_model(self, model: "nn.Module") -> Iterator["nn.Module"]:
        """Under ZeRO-3 on several processes, a plain copy on every rank (:func:`computing_twin`) of the
        full weights, gathered by ``deepspeed.zero.GatheredParameters``: ZeRO-3's per-layer gathers need
        every rank in the same forward, while each rank generates its own dialogues. (Several ranks need
        GPUs: DeepSpeed's collectives do not run on CPU ranks, so this path is not tested here.) ZeRO-1/2
        and one process compute with the unwrapped model."""
        assert self.accelerator is not None
        unwrapped = self.unwrap(model)
        if self.stage != 3 or self.accelerator.num_processes <= 1:
            yield unwrapped
            return
        import deepspeed

        from transformers.integrations import deepspeed as hf_deepspeed

        with deepspeed.zero.GatheredParameters(list(unwrapped.parameters()), modifier_rank=None):
            full = {name: tensor.detach().clone() for name, tensor in unwrapped.state_dict().items()}
        # transformers builds a model inside deepspeed.zero.Init (partitioned) while the run's ZeRO-3
        # config is registered with it; the copy must be whole, so it is built with that unset.
        registered = hf_deepspeed._hf_deepspeed_config_weak_ref
        hf_deepspeed.unset_hf_deepspeed_config()
        try:
            twin = computing_twin(unwrapped, full, self.original_class, device=self.accelerator.device)
        finally:
            hf_deepspeed._hf_deepspeed_config_weak_ref = registered
        del full
        try:
            yield twin
        finally:
            del twin

    # -- model -----------------------------------------------------------------------------
    def parameter_counts(self, model: "nn.Module") -> tuple[int, int]:
        # ZeRO-3 partitions parameters at construction; ds_numel is the full size.
        params = list(model.parameters())
        size = [getattr(p, "ds_numel", p.numel()) for p in params]
        return sum(size), sum(n for n, p in zip(size, params) if p.requires_grad)

    def clip_grad_norm(self, model: "nn.Module", max_norm: Optional[float]) -> Optional[float]:
        # The engine stepped (and clipped, with the JSON's gradient_clipping) inside backward at
        # the boundary and kept the global norm it computed before clipping.
        import torch

        norm = model.get_global_grad_norm() if hasattr(model, "get_global_grad_norm") else None
        if norm is None:
            return None
        return float(norm.item() if isinstance(norm, torch.Tensor) else norm)

    # -- the loss's output head ------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, params: list["nn.Parameter"]) -> Iterator[None]:
        """Gather ZeRO-3-partitioned ``params`` for the block (a no-op for those already whole).

        Run as the head module's forward (see the loss), DeepSpeed's own hooks have usually
        gathered the module's parameters already, and this finds nothing to gather.
        """
        partitioned = [p for p in params if getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"]
        if not partitioned:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            yield

    def head_problem(self, head: "nn.Module") -> str:
        # ZeRO-3 hooks gather only a module's own parameters; a LoRA layer has none of its own,
        # so the factors saved for the effective weight's backward would be empty shards.
        if hasattr(head, "lora_A") and any(hasattr(p, "ds_id") for p in head.parameters()):
            return "DeepSpeed ZeRO-3 parameters"
        return ""

    @classmethod
    def planned_head_problem(cls, config: Any, *, lora_head: bool) -> str:
        return "DeepSpeed ZeRO-3 parameters" if lora_head and config.stage == 3 else ""

    # -- checkpoints -----------------------------------------------------------------------
    def reshard_problem(self, saved_world_size: int, world_size: int) -> str:
        if saved_world_size == world_size:
            return ""
        # DeepSpeed's own route to another number of ranks (deepspeed.checkpoint.ds_to_universal,
        # then "checkpoint": {"load_universal": true}) is not part of this engine's load_state.
        return (f"DeepSpeed ZeRO-{self.stage} saved its optimizer states{' and weights' if self.stage == 3 else ''} "
                f"in {saved_world_size} per-rank partitions, which its load_checkpoint restores onto "
                f"{saved_world_size} processes only (this run has {world_size}); mmtune does not convert them "
                "(DeepSpeed's universal checkpoint, python -m deepspeed.checkpoint.ds_to_universal, is not wired "
                f"into its resume). Relaunch on {saved_world_size} processes (accelerate launch --num_processes "
                f"{saved_world_size} --config_file <the DeepSpeed launch file> recipes/sft.py), or train with "
                "training.backend.engine=fsdp2, whose checkpoints resume on another number of ranks")

    def merge_problem(self) -> str:
        return "ZeRO-3 LoRA runs save the adapter only; merge it with peft offline" if self.stage == 3 else ""

    # -- planning --------------------------------------------------------------------------
    @classmethod
    def state_memory(cls, config: Any, *, total: int, trainable: int, weight_bytes: int,
                     num_gpus: int, num_layers: int = 1, root_params: int = 0) -> StateMemory:
        g = max(1, num_gpus)
        weights, grads = float(weight_bytes * total), float(weight_bytes * trainable)
        optim = adamw_bytes(trainable, weight_bytes) / g  # stage >= 1
        if config.stage >= 2:
            grads /= g
        if config.stage >= 3:
            weights /= g
        if config.offload_optimizer:
            optim = 0.0
        if config.offload_params and config.stage >= 3:
            weights = 0.0
        # ZeRO-3 gathers the layers it is computing (stage3_max_live_parameters, 1e9 by
        # default): that working set sits on every GPU on top of the shards.
        gathered = float(weight_bytes * min(total, ZERO3_LIVE_PARAMETERS)) if config.stage >= 3 else 0.0
        return StateMemory(weights=weights, gradients=grads, optimizer=optim, gathered=gathered)

    @classmethod
    def describe(cls, config: Any) -> str:
        offload = [name for name, on in (("optimizer", config.offload_optimizer), ("weights", config.offload_params))
                   if on]
        return f"DeepSpeed ZeRO-{config.stage}" + (f" ({' and '.join(offload)} offloaded to CPU)" if offload else "")

"""PyTorch FSDP2: ``torch.distributed.fsdp.fully_shard`` on a one-dimensional device mesh.

Each sharding unit (``training.backend.fsdp2.units``: the language model's decoder layers,
the vision tower's blocks or the whole tower) is all-gathered around its own forward and
backward and holds only ``1/world_size`` of its weights, gradients and AdamW states in
between; the rest of the model (embeddings, projector, final norm, output head) is the root
unit. The units come from the adapter's module groups (:class:`~mmtune.models.base.ModuleGroups`),
found the same way for every family: no family is named here.

The linear cross-entropy (``training.loss_impl=chunked``/``fused``) runs on any number of
ranks: it reads the output head in the root unit, and its loss joins the model's outputs with
zero gradients, because FSDP2 starts the root unit's backward (with an all-gather prefetch of
the last unit) from hooks on those outputs. Without that join the hook runs only on a rank
whose outputs the loss reaches anyway (the image features a rank with images returns), and a
text-only rank beside it never joins that all-gather.

Launched by ``torchrun`` (or an accelerate multi-GPU config), not through accelerate's FSDP
plugin: with ``cpu=True`` that plugin silently runs DDP. accelerate still places the
devices, autocasts, counts the accumulation and saves the scheduler and every rank's RNG;
the model and optimizer states are saved sharded by ``torch.distributed.checkpoint``, which
reshards them on load, so a run resumes exactly on another number of ranks with the same
global batch (ranks x gradient accumulation, checked by
:meth:`~mmtune.data.datamodule.SFTDataModule.check_state`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, List, Optional

from mmtune.training.engines.base import (Engine, EngineContext, StateMemory, adamw_bytes, computing_twin, rebuilt_model,
                                          register_engine)

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from mmtune.models.base import ModuleGroups

__all__ = ["FSDP2Engine", "FSDP2EngineConfig", "UNITS", "sharding_units"]

UNITS = ("decoder_layers", "vision_layers", "vision_tower")
SHARDED_DIR = "sharded"
"""Where, inside a checkpoint, ``torch.distributed.checkpoint`` writes model and optimizer shards."""


def _largest_layer_list(modules: list["nn.Module"]) -> list["nn.Module"]:
    """The blocks of a stack: the ``nn.ModuleList`` with the most parameters under ``modules``."""
    from torch import nn

    best, best_size = [], 0
    for top in modules:
        for module in top.modules():
            if isinstance(module, nn.ModuleList) and len(module) > 1:
                size = sum(p.numel() for p in module.parameters())
                if size > best_size:
                    best, best_size = list(module), size
    return best


def sharding_units(groups: "ModuleGroups") -> dict[str, list["nn.Module"]]:
    """Every unit name of :data:`UNITS` with the modules it makes, from a model's groups.

    ``decoder_layers``: the blocks of the language model's layer stack; ``vision_layers``:
    the blocks of the vision tower's; ``vision_tower``: the vision tower's top modules.
    A name whose modules the model does not have maps to an empty list.
    """
    from torch import nn

    # A group may list a container (a ModuleList of blocks): its members are the units, as
    # fully_shard needs a module with a forward.
    tower = [child for module in groups.vision
             for child in (module.children() if isinstance(module, (nn.ModuleList, nn.ModuleDict)) else [module])]
    return {"decoder_layers": _largest_layer_list(groups.language_model),
            "vision_layers": _largest_layer_list(groups.vision),
            "vision_tower": tower}


def _fully_shard(module: "nn.Module", **kwargs: Any) -> None:
    """``fully_shard(module)``, keeping transformers' output capture of ``module`` working.

    ``fully_shard`` gives the module a new class (``FSDP<Name>``); transformers looks up
    which outputs a model can record (``output_hidden_states``, which LLaVA reads from its
    vision tower) by the model's class, so the new class is registered with the old one's.
    """
    from torch.distributed.fsdp import fully_shard

    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # older transformers record outputs without a registry
        _CAN_RECORD_REGISTRY = None
    recorded = _CAN_RECORD_REGISTRY.get(module) if _CAN_RECORD_REGISTRY is not None else None
    fully_shard(module, **kwargs)
    if recorded:
        _CAN_RECORD_REGISTRY[module] = recorded


@dataclass
class FSDP2EngineConfig:
    """``training.backend.fsdp2``: PyTorch FSDP2 (``fully_shard`` on a 1-D device mesh)."""

    units: List[str] = field(default_factory=lambda: ["decoder_layers", "vision_tower"])
    """Sharding units, each all-gathered as one piece around its forward and backward:
    ``decoder_layers`` (each language-model layer), ``vision_layers`` (each vision-tower
    block), ``vision_tower`` (the whole tower, what ``vision_layers`` leaves). The rest
    (embeddings, projector, final norm, output head) is the root unit."""
    reshard_after_forward: bool = True
    """Free each unit's gathered weights after its forward (gathered again for backward):
    less memory, one more all-gather per unit and step."""
    mixed_precision: str = "auto"
    """Weights' dtype inside forward and backward: ``auto`` (bf16 when
    ``training.mixed_precision=bf16``, else fp32), ``bf16`` or ``fp32``. Gradients are
    reduced and the optimizer steps in fp32 either way."""
    cpu_offload: bool = False
    """Keep parameter shards, gradients and optimizer states in CPU memory (GPU runs)."""


@register_engine
class FSDP2Engine(Engine):
    """Fully sharded data parallel, PyTorch's ``fully_shard`` (``training.backend.engine=fsdp2``)."""

    name = "fsdp2"
    settings_class = FSDP2EngineConfig
    sequence_parallel_problem = ""
    needs_distributed_launch = True  # fully_shard's device mesh is a process group, even of one rank
    # The root unit's backward (and its backward prefetch) starts from hooks on the model's
    # outputs; the linear cross-entropy joins them so that happens at the same point on every
    # rank, a text-only micro-batch's as an image one's (see loss.joined_with_outputs).
    loss_joins_model_outputs = True
    launch_hint = "torchrun --nproc_per_node N recipes/sft.py"

    # -- start-up --------------------------------------------------------------------------
    @classmethod
    def config_problems(cls, config: Any, context: EngineContext) -> list[str]:
        problems = super().config_problems(config, context)
        c = config
        unknown = [u for u in c.units if u not in UNITS]
        if unknown:
            problems.append(f"training.backend.fsdp2.units: {', '.join(map(repr, unknown))} unknown; use any of "
                            f"{', '.join(UNITS)}")
        if len(set(c.units)) != len(c.units):
            problems.append(f"training.backend.fsdp2.units={list(c.units)} names a unit twice")
        if c.mixed_precision not in ("auto", "bf16", "fp32"):
            problems.append(f"training.backend.fsdp2.mixed_precision={c.mixed_precision!r}: use auto, bf16 or fp32")
        if context.mixed_precision == "fp16":
            problems.append("training.mixed_precision=fp16 with training.backend.engine=fsdp2: FSDP2 has no loss "
                            "scaler here; use bf16 (A100/H100) or ddp/deepspeed for fp16")
        if context.compile:
            problems.append("training.compile=true with training.backend.engine=fsdp2 is not supported yet: set "
                            "training.compile=false")
        return problems

    def evaluation_problem(self, num_processes: int) -> str:
        if num_processes > 1 and self.context.quantized_base:
            return (f"FSDP2 on {num_processes} processes with a 4-bit (QLoRA) base: each rank generates on a copy "
                    "of the full weights, which a 4-bit base cannot be rebuilt into. Evaluate the saved final/ "
                    "adapter with recipes/evaluate.py (mmtune evaluate)")
        return ""

    @contextlib.contextmanager
    def evaluation_model(self, model: "nn.Module") -> Iterator["nn.Module"]:
        """On several processes, an unsharded copy on every rank (:func:`computing_twin`) holding the full
        weights gathered with ``torch.distributed.checkpoint``'s ``get_model_state_dict``: every sharded
        unit's forward would all-gather from all ranks at once, while each rank generates its own
        dialogues. It costs the model's full weights once more per GPU for the evaluation's length.
        One process computes with the model itself."""
        assert self.accelerator is not None
        if self.accelerator.num_processes <= 1 or getattr(self, "quantized", False):
            yield model
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # on every rank
        twin = computing_twin(model, full, self.original_class, device=self.accelerator.device,
                              dtype=self._param_dtype())
        del full
        try:
            yield twin
        finally:
            del twin

    # -- model -----------------------------------------------------------------------------
    def _param_dtype(self) -> Optional["Any"]:
        import torch

        wanted = self.config.mixed_precision
        if wanted == "auto":
            wanted = "bf16" if self.context.mixed_precision == "bf16" else "fp32"
        return torch.bfloat16 if wanted == "bf16" else None

    def shard(self, model: "nn.Module", groups: "ModuleGroups") -> "nn.Module":
        """``fully_shard`` each configured unit, then the root; parameters become DTensor shards.

        Raises:
            ValueError: a configured unit the model does not have (the key and the units it has).
        """
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        from mmtune.models.base import unwrap_model

        acc = self.accelerator
        assert acc is not None
        found = sharding_units(groups)
        missing = [u for u in self.config.units if not found[u]]
        if missing:
            have = [u for u in UNITS if found[u]]
            raise ValueError(f"training.backend.fsdp2.units names {', '.join(missing)}, which this model does not "
                             f"have; it has {', '.join(have) or 'none of ' + ', '.join(UNITS)}: remove "
                             f"{', '.join(missing)} from training.backend.fsdp2.units")
        model.to(acc.device)
        self.mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
        kwargs: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.config.reshard_after_forward,
                                  "mp_policy": MixedPrecisionPolicy(param_dtype=self._param_dtype(),
                                                                    reduce_dtype=torch.float32)}
        if self.config.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        done: set[int] = set()
        for unit in self.config.units:
            for module in found[unit]:
                # vision_tower after vision_layers: the tower unit keeps what its blocks leave.
                if id(module) not in done:
                    _fully_shard(module, **kwargs)
                    done.add(id(module))
        # The output head stays in the root unit, which FSDP2 keeps unsharded from its forward
        # to its backward: the linear cross-entropy reads the head's weight after the model's
        # forward (Engine.gathered makes it whole should it be sharded then). As a unit of its
        # own, the loss's call of the head outside the root's forward makes FSDP2 close the
        # iteration's other units early and free weights their backward still reads. The
        # loss also joins the model's outputs (loss_joins_model_outputs), so the root unit's
        # backward starts right after the loss on every rank, with or without images.
        _fully_shard(model, **kwargs)
        self.units = {u: len(found[u]) for u in self.config.units}
        self.quantized = bool(getattr(unwrap_model(model), "is_quantized", False))
        return model

    def prepare(self, model: "nn.Module", optimizer: Any, scheduler: Any) -> tuple["nn.Module", Any, Any]:
        # The model is sharded already and the optimizer holds its shards; accelerate only
        # wraps the scheduler (saved with the RNG states by save_state).
        acc = self.accelerator
        assert acc is not None
        self.model, self.optimizer = model, optimizer
        return model, optimizer, acc.prepare(scheduler)

    def unwrap(self, model: "nn.Module") -> "nn.Module":
        return model  # fully_shard changes the modules' classes in place; there is no wrapper

    @contextlib.contextmanager
    def gathered(self, params: list["nn.Parameter"]) -> Iterator[None]:
        """Unshard the unit that owns any still-sharded ``params``.

        The output head lives in the root unit, which FSDP2 leaves unsharded after the
        model's forward, so the loss usually finds it whole; otherwise the unit stays
        unsharded until its backward is done, where FSDP reshards it.
        """
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        sharded = {id(p) for p in params if isinstance(p, DTensor)}
        if sharded:
            owner = None
            for module in self.model.modules():  # pre-order: the last match is the innermost unit
                if isinstance(module, FSDPModule) and sharded & {id(p) for p in module.parameters()}:
                    owner = module
            if owner is not None:
                owner.unshard()
        yield

    # -- one step --------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, model: "nn.Module") -> Iterator[None]:
        acc = self.accelerator
        assert acc is not None
        with acc.accumulate(model):
            # Reduce-scatter once per optimizer step: earlier micro-batches keep unsharded
            # gradients locally (accelerate's no_sync does this for DDP).
            model.set_requires_gradient_sync(acc.sync_gradients)
            yield

    def clip_grad_norm(self, model: "nn.Module", max_norm: Optional[float]) -> Optional[float]:
        import torch

        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return None
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor: the global norm
        return float(norm)

    # -- checkpoints -----------------------------------------------------------------------
    def save_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        acc = self.accelerator
        assert acc is not None
        acc.save_state(str(directory), safe_serialization=True)  # scheduler and every rank's RNG
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(directory) / SHARDED_DIR))

    def load_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        acc = self.accelerator
        assert acc is not None
        acc.load_state(str(directory))
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        # Resharded on load: the checkpoint may come from another number of ranks.
        dcp.load(state, checkpoint_id=str(Path(directory) / SHARDED_DIR))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def full_state_dict(self, model: "nn.Module") -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Every rank takes part in the all-gathers; the main process keeps full CPU tensors.
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def final_model(self, model: "nn.Module", state_dict: dict[str, Any]) -> "nn.Module":
        """An unsharded CPU twin of ``model`` holding ``state_dict`` (the gathered full weights).

        ``fully_shard`` gives every unit a new class (``FSDP<Name>``, which transformers'
        save code does not recognise when it maps parameter names back to the checkpoint's)
        and forbids copying it, so the twin is built again: the model's original class from
        its own config on the meta device (no memory, no initialisation), wrapped by peft
        with the run's LoRA config for a peft model, then given the full weights with
        ``assign=True``. ``final/`` is then written by the same code as under DDP, LoRA
        merged by peft's ``merge_and_unload``.

        Raises:
            RuntimeError: the copy's parameter names differ from the gathered ones (names both).
        """
        if getattr(self, "quantized", False):
            return model  # a 4-bit base cannot be rebuilt from its config: the adapter is saved alone
        return rebuilt_model(model, state_dict, self.original_class)

    def merge_problem(self) -> str:
        if getattr(self, "quantized", False):
            return ("FSDP2 QLoRA runs save the adapter only (a 4-bit base cannot be rebuilt unsharded); merge it with "
                    "peft offline")
        return ""

    def original_class(self, module: "nn.Module") -> type:
        from torch.distributed.fsdp import FSDPModule

        # fully_shard's class derives from FSDPModule and the module's own class, in that order.
        return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))

    # -- planning --------------------------------------------------------------------------
    @classmethod
    def state_memory(cls, config: Any, *, total: int, trainable: int, weight_bytes: int,
                     num_gpus: int, num_layers: int = 1, root_params: int = 0) -> StateMemory:
        g = max(1, num_gpus)
        # Sharded parameters and gradients stay in the weights' dtype (bf16 compute weights
        # are cast copies inside the units), AdamW's m and v are fp32, plus an fp32 master
        # copy when the weights are 16-bit; all divided by the ranks.
        weights = float(weight_bytes * total) / g
        grads = float(weight_bytes * trainable) / g
        optim = adamw_bytes(trainable, weight_bytes) / g
        if config.cpu_offload:
            weights = grads = optim = 0.0
        # The unit being computed and the next one prefetched: about two decoder layers of
        # full weights on top of the shards.
        gathered = float(weight_bytes * total) * min(1.0, 2 / max(1, num_layers)) if g > 1 else 0.0
        # The root unit (embeddings, the output head the loss reads) stays whole from its
        # forward to the end of its backward.
        if g > 1:
            gathered += float(weight_bytes * root_params) * (1 - 1 / g)
        return StateMemory(weights=weights, gradients=grads, optimizer=optim, gathered=gathered)

    @classmethod
    def describe(cls, config: Any) -> str:
        return (f"FSDP2 (fully_shard units: {', '.join(config.units) or 'root only'}; "
                f"reshard after forward: {config.reshard_after_forward}"
                + ("; CPU offload" if config.cpu_offload else "") + ")")

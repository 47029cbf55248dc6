"""The seam between the training core and a distributed engine.

The loop (:mod:`mmtune.training.loop`), the loss (:mod:`mmtune.training.loss`) and the
checkpoints (:mod:`mmtune.training.checkpoint`) talk to one :class:`Engine` and never ask
which one it is. An engine wraps the model and optimizer, says when gradients are synced,
clips them, gathers a sharded parameter for the loss's output head, saves and loads the
resumable (possibly sharded) state, gives the full weights for ``final/`` and states what
it needs from the launch. ``mmtune plan`` asks the same classes for their memory per GPU
(:meth:`Engine.state_memory`).

Engines register by name (:func:`register_engine`, below); the config
key ``training.backend.engine`` picks one and ``training.backend.<name>`` holds its
typed settings.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from accelerate import Accelerator
    from torch import nn

    from mmtune.models.base import ModuleGroups

__all__ = ["Engine", "EngineLaunchError", "StateMemory", "launch_file_engine", "launched_engine", "register_engine"]


class EngineLaunchError(RuntimeError):
    """The process was launched for another engine than ``training.backend.engine`` names."""


def launched_engine() -> Optional[str]:
    """The engine the launcher set this process up for, as ``accelerate launch`` records it.

    ``accelerate launch --config_file X`` passes its ``distributed_type`` to the process it
    starts (the ``ACCELERATE_USE_*`` flags of accelerate's launch protocol): ``deepspeed``
    for a DeepSpeed config, ``accelerate-fsdp`` for accelerate's own FSDP plugin, ``None``
    for plain process launches (``python``, ``torchrun``, a multi-GPU accelerate config),
    which every engine accepts. Only read to refuse a mismatch with the config; the config
    alone chooses the engine.
    """
    from accelerate.utils import parse_flag_from_env

    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return "accelerate-fsdp"
    return None


def launch_file_engine(launch: dict[str, Any]) -> Optional[str]:
    """The engine an accelerate config file (parsed) starts processes for, named as
    :func:`launched_engine` names it: ``deepspeed``, ``accelerate-fsdp`` or ``None`` (plain
    processes, which every engine accepts)."""
    kind = str(launch.get("distributed_type", "")).upper()
    if kind == "DEEPSPEED" or launch.get("deepspeed_config"):
        return "deepspeed"
    if kind == "FSDP":
        return "accelerate-fsdp"
    return None


@dataclass(frozen=True)
class EngineContext:
    """What an engine knows of the run beyond its own ``training.backend.<name>`` section.

    An engine never sees the run's whole config: the training room makes this from it
    (:func:`mmtune.training.config.engine_context`).
    """

    mixed_precision: str = "no"
    """``training.mixed_precision``: ``no``, ``bf16`` or ``fp16``."""
    max_grad_norm: Optional[float] = None
    """``training.max_grad_norm`` (``None``: no clipping)."""
    compile: bool = False
    """``training.compile``: the model is compiled after the engine wraps it."""
    trains_vision: bool = False
    """The vision tower's module group trains (``training.vision.train``): some of its
    parameters may get no gradient in a step (a text-only micro-batch)."""
    quantized_base: bool = False
    """The model's base weights are loaded in 4 bits (``peft.method=qlora``): a config cannot rebuild them."""
    sequence_parallel: int = 1
    """``training.sequence_parallel.size``: processes sharing one row."""


@dataclass(frozen=True)
class StateMemory:
    """Bytes per GPU of the training state under an engine (what ``mmtune plan`` adds up).

    ``gathered`` is the working set of full weights an engine that shards them holds
    while computing (a layer, or DeepSpeed's live-parameter budget).
    """

    weights: float
    gradients: float
    optimizer: float
    gathered: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.gathered


def _distributed() -> bool:
    """Whether a distributed launcher (torchrun, accelerate launch) started this process: its
    process group exists, or the launcher's rendezvous variables are there to create it."""
    import os

    import torch.distributed as dist

    return dist.is_available() and (dist.is_initialized() or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ))


class Engine(ABC):
    """One distributed engine behind the training core.

    Lifecycle, as the loop calls it::

        engine = build_engine(name, settings, context)  # its own section, no side effects
        acc = Accelerator(**engine.accelerator_kwargs(), ...)
        engine.start(acc)                               # a launch for another engine is refused
        model = engine.shard(model, groups)             # before the optimizer sees the parameters
        model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
        with engine.accumulate(model):                  # one micro-batch
            engine.backward(loss)
            if engine.sync_gradients: norm = engine.clip_grad_norm(model, max_norm)
        engine.reshard_problem(saved_world_size, world_size)  # a resume, before any load
        engine.save_state(directory) / engine.load_state(directory)
        state_dict = engine.full_state_dict(model)      # final/: a collective, complete on the main process
        module = engine.final_model(model, state_dict)  # main process: what save_pretrained / the merge run on
    """

    name: ClassVar[str]
    """The value of ``training.backend.engine`` that selects this engine."""
    package: ClassVar[Optional[str]] = None
    """The importable package the engine needs beyond torch and accelerate (checked at start-up)."""
    settings_class: ClassVar[type]
    """The dataclass of the engine's ``training.backend.<name>`` section (declared in its module)."""
    sequence_parallel_problem: ClassVar[str] = "never run under this engine"
    """Why ``training.sequence_parallel.size > 1`` is refused under this engine; empty for an
    engine it runs under (tested there against one process)."""

    def __init__(self, config: Any, context: EngineContext = EngineContext()):
        """Args:
            config: this engine's ``training.backend.<name>`` section (an instance of ``settings_class``).
            context: what the engine needs to know of the rest of the run.
        """
        self.config = config
        self.context = context
        self.accelerator: Optional["Accelerator"] = None

    # -- start-up --------------------------------------------------------------------------
    @classmethod
    def config_problems(cls, config: Any, context: EngineContext) -> list[str]:
        """What is wrong with ``config`` (``training.backend.<name>``) and ``context`` for this engine,
        each with its key (empty when fine).

        Called by :func:`mmtune.training.config.validate`, before anything is built.
        """
        import importlib.util

        if cls.package and importlib.util.find_spec(cls.package) is None:
            return [f"training.backend.engine={cls.name} needs the {cls.package!r} package, which is not installed: "
                    f"install it (pip install {cls.package}) or choose another training.backend.engine"]
        return []

    def accelerator_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``accelerate.Accelerator`` this engine needs."""
        import torch

        return {"cpu": not torch.accelerator.is_available()}

    def start(self, accelerator: "Accelerator") -> None:
        """Take the run's accelerator; refuse a process the launcher set up for another engine (both named).

        Raises:
            EngineLaunchError: the launch and ``training.backend.engine`` disagree.
        """
        self.accelerator = accelerator
        launched = launched_engine()
        if launched is not None and launched != self.name:
            raise EngineLaunchError(
                f"training.backend.engine={self.name} but the launcher started this process for {launched} "
                f"(accelerate launch --config_file with distributed_type "
                f"{'DEEPSPEED' if launched == 'deepspeed' else 'FSDP'}): launch with "
                f"{self.launch_hint} or set training.backend.engine={launched.replace('accelerate-', '')}")
        problem = self.launch_problem(self.context, num_processes=accelerator.num_processes, distributed=_distributed())
        if problem:
            raise EngineLaunchError(problem)

    needs_distributed_launch: ClassVar[bool] = False
    """Whether the engine needs a process group even on one process (FSDP2's device mesh), which a
    plain ``python`` start does not create."""

    @classmethod
    def launch_problem(cls, context: EngineContext, *, num_processes: int, distributed: bool) -> str:
        """Why this launch (``num_processes`` processes; ``distributed``: started by a distributed
        launcher) cannot run the run ``context`` describes under this engine, with the command that
        can; empty when it can.

        Asked by :meth:`start`, before any model is loaded: the engine's own need of a process
        group, and ``training.sequence_parallel.size`` against the launched ranks.
        """
        from mmtune.training.sequence_parallel.groups import size_problems

        sp = context.sequence_parallel
        problems = []
        if cls.needs_distributed_launch and not distributed:
            problems.append(f"training.backend.engine={cls.name} shards the model over a process group, which a "
                            "plain `python` start does not create")
        if sp > 1:
            problems += size_problems(sp, num_processes)
        if not problems:
            return ""
        n = max(sp, 2)
        return ("; ".join(problems) + f". Launch it with {n} processes (or a multiple of {n}): "
                f"torchrun --nproc_per_node {n} -m mmtune train <the same overrides> (or torchrun --nproc_per_node "
                f"{n} recipes/sft.py <the same overrides>); or train on one process with "
                "training.backend.engine=ddp training.sequence_parallel.size=1")

    @classmethod
    def launch_config_problem(cls, config: Any, launch: dict[str, Any], origin: str,
                              resolve: Callable[[str], str] = str) -> str:
        """Why the accelerate config file ``origin`` (parsed: ``launch``) cannot start this engine
        with ``config``, its ``training.backend.<name>`` section; empty when it can. ``resolve``
        finds a file the launch file names (relative paths: from the current folder, then the project).

        ``mmtune plan`` asks before a job is submitted; at start-up :meth:`start` refuses the
        same launch from what the launcher passed to the process.
        """
        launched = launch_file_engine(launch)
        if launched is None or launched == cls.name:
            return ""
        return (f"training.backend.engine={cls.name} but {origin} launches {launched} (distributed_type "
                f"{launch.get('distributed_type')}): set training.backend.engine={launched.replace('accelerate-', '')} "
                "or launch with another config")

    launch_hint: ClassVar[str] = "torchrun --nproc_per_node N recipes/sft.py (or python recipes/sft.py)"
    """How to launch this engine, for error messages and docs."""

    def evaluation_problem(self, num_processes: int) -> str:
        """Why in-training generation (``training.eval_before/eval_after``) cannot run under
        this engine on ``num_processes`` processes; empty when it can."""
        return ""

    @contextlib.contextmanager
    def evaluation_model(self, model: "nn.Module") -> Iterator["nn.Module"]:
        """The model in-training evaluation generates with on this rank, for the block.

        Evaluation is data-parallel: every rank answers its own share of the dialogues, with
        its own number of forward passes, so the module it gets must compute without the
        other ranks. Engines with full weights on every rank give the unwrapped model; an
        engine that shards them gathers the full weights into a plain copy (a collective:
        every rank enters the block), freed when the block ends.
        """
        yield self.unwrap(model)

    # -- model -----------------------------------------------------------------------------
    def shard(self, model: "nn.Module", groups: "ModuleGroups") -> "nn.Module":
        """Split ``model`` into this engine's sharding units before the optimizer is built
        (engines that shard inside :meth:`prepare`, or not at all, return it unchanged)."""
        return model

    def prepare(self, model: "nn.Module", optimizer: Any, scheduler: Any) -> tuple["nn.Module", Any, Any]:
        """Wrap ``model``, its optimizer and scheduler for training (accelerate's ``prepare``)."""
        assert self.accelerator is not None
        self.model, self.optimizer = model, optimizer
        model, optimizer, scheduler = self.accelerator.prepare(model, optimizer, scheduler)
        self.model, self.optimizer = model, optimizer
        return model, optimizer, scheduler

    def parameter_counts(self, model: "nn.Module") -> tuple[int, int]:
        """``(all, trainable)`` parameters of ``model`` at their full size, however sharded."""
        params = list(model.parameters())
        return (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad))

    def unwrap(self, model: "nn.Module") -> "nn.Module":
        """The model without this engine's wrapper (the module ``save_pretrained`` belongs to)."""
        assert self.accelerator is not None
        return self.accelerator.unwrap_model(model)

    # -- one step --------------------------------------------------------------------------
    def accumulate(self, model: "nn.Module") -> contextlib.AbstractContextManager:
        """The context of one micro-batch: gradients sync only on the step's last one."""
        assert self.accelerator is not None
        return self.accelerator.accumulate(model)

    @property
    def sync_gradients(self) -> bool:
        """Whether the current micro-batch is the last of its optimizer step."""
        assert self.accelerator is not None
        return self.accelerator.sync_gradients

    def backward(self, loss: "torch.Tensor") -> None:
        """Backward of one micro-batch's (scaled) loss; accelerate divides it by the accumulation."""
        assert self.accelerator is not None
        self.accelerator.backward(loss)

    def clip_grad_norm(self, model: "nn.Module", max_norm: Optional[float]) -> Optional[float]:
        """Clip the step's gradients to ``max_norm`` (``None``: only measure); the norm before clipping."""
        assert self.accelerator is not None
        norm = self.accelerator.clip_grad_norm_(model.parameters(), max_norm or math.inf)
        return None if norm is None else float(norm)

    # -- the loss's output head ------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, params: list["nn.Parameter"]) -> Iterator[None]:
        """Make ``params`` whole for the block (the loss reads the output head's weight)."""
        yield

    def head_problem(self, head: "nn.Module") -> str:
        """Why the linear cross-entropy cannot read ``head`` under this engine (empty when it can)."""
        return ""

    loss_joins_model_outputs: ClassVar[bool] = False
    """The linear cross-entropy's loss also reaches the model forward's outputs (with zero
    gradients), so backward passes through them first, as it does from materialised logits:
    for an engine whose hooks on those outputs start its backward (FSDP2's root unit)."""

    @classmethod
    def planned_head_problem(cls, config: Any, *, lora_head: bool) -> str:
        """:meth:`head_problem` predicted from the config (``mmtune plan``)."""
        return ""

    # -- checkpoints -----------------------------------------------------------------------
    def save_state(self, directory: Path) -> None:
        """Write the resumable state of every rank into ``directory`` (call on every rank)."""
        assert self.accelerator is not None
        self.accelerator.save_state(str(directory), safe_serialization=True)

    def load_state(self, directory: Path) -> None:
        """Restore what :meth:`save_state` wrote (call on every rank)."""
        assert self.accelerator is not None
        self.accelerator.load_state(str(directory))

    def reshard_problem(self, saved_world_size: int, world_size: int) -> str:
        """Why :meth:`load_state` cannot restore a state saved on ``saved_world_size`` processes onto
        ``world_size`` (empty when it can; always when they are equal).

        Checked when a resume starts, before anything is loaded. The default state (accelerate's:
        full weights and optimizer from the main process, every rank's RNG) loads on any number.
        """
        return ""

    def full_state_dict(self, model: "nn.Module") -> dict[str, Any]:
        """The full (unsharded) weights, complete on the main process (a collective: every rank calls it)."""
        assert self.accelerator is not None
        return self.accelerator.get_state_dict(model)

    def merge_problem(self) -> str:
        """Why ``final/`` cannot fold LoRA into the weights here (empty when it can)."""
        return ""

    def final_model(self, model: "nn.Module", state_dict: dict[str, Any]) -> "nn.Module":
        """The module ``final/`` is written from, holding ``state_dict`` (main process only).

        Its ``save_pretrained`` writes the checkpoint and, for a peft model, its
        ``merge_and_unload`` folds LoRA in: the same save code under every engine. Here the
        unwrapped model itself, or for a peft model whose LoRA is merged a plain copy
        rebuilt from ``state_dict`` (:func:`rebuilt_model`): the merge works on a copy, and
        the trained model, which the launcher's wrapper has changed, cannot be deep-copied
        on several processes (a 4-bit QLoRA base, which a config cannot rebuild, still is).
        """
        from mmtune.training.peft_setup import is_peft_model

        unwrapped = self.unwrap(model)
        # A 4-bit (QLoRA) base cannot be rebuilt from its config; peft merges it on a deep copy.
        if (is_peft_model(unwrapped) and not self.merge_problem()
                and not getattr(unwrapped.get_base_model(), "is_quantized", False)):
            return rebuilt_model(unwrapped, state_dict, self.original_class)
        return unwrapped

    def original_class(self, module: "nn.Module") -> type:
        """The class ``module`` was built with, before this engine changed it (if it does)."""
        return type(module)

    # -- planning --------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def state_memory(cls, config: Any, *, total: int, trainable: int, weight_bytes: int,
                     num_gpus: int, num_layers: int = 1, root_params: int = 0) -> StateMemory:
        """Bytes per GPU of weights, gradients and AdamW states under this engine.

        Args:
            config: the engine's ``training.backend.<name>`` section.
            total, trainable: parameters of the model, all and trained.
            weight_bytes: bytes per weight in its stored dtype.
            num_gpus: data-parallel ranks.
            num_layers: decoder layers (an engine that gathers one layer at a time holds that much).
            root_params: parameters outside the decoder layers and the vision tower (input
                embeddings, output head): an engine whose root unit holds them whole through
                the step counts them.
        """

    @classmethod
    def describe(cls, config: Any) -> str:
        """One line for logs and ``mmtune plan``."""
        return cls.name


def adamw_bytes(trainable: int, weight_bytes: int) -> float:
    """AdamW's m and v in fp32, plus an fp32 master copy when the weights are 16-bit."""
    return float((8 + (4 if weight_bytes < 4 else 0)) * trainable)


def computing_twin(model: "nn.Module", state_dict: dict[str, Any], original_class: Callable[["nn.Module"], type],
                   *, device: Any, dtype: Any = None) -> "nn.Module":
    """A plain copy of ``model`` holding the full ``state_dict`` that computes on its own, on ``device``.

    :func:`rebuilt_model`, plus the buffers a state dict does not hold (rotary frequencies,
    non-persistent) copied from ``model`` (an engine never shards buffers), floating weights
    cast to ``dtype`` when given (the dtype the engine computes in), and generation's cache on.
    """
    twin = rebuilt_model(model, state_dict, original_class)
    buffers = dict(model.named_buffers())
    for name, buffer in list(twin.named_buffers()):
        if buffer.is_meta and name in buffers:
            owner, _, attr = name.rpartition(".")
            twin.get_submodule(owner)._buffers[attr] = buffers[name].detach().clone()
    twin.to(device)
    if dtype is not None:
        for p in twin.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    for config in (getattr(twin, "config", None), getattr(getattr(twin, "get_base_model", lambda: None)(), "config",
                                                          None)):
        if config is not None:
            config.use_cache = True  # gradient checkpointing turned it off for training
    return twin.eval()


def rebuilt_model(model: "nn.Module", state_dict: dict[str, Any],
                   original_class: Callable[["nn.Module"], type]) -> "nn.Module":
    """A plain module like ``model`` (a transformers model, perhaps inside peft) holding ``state_dict``.

    Built from the model's config with ``original_class(model)`` on the meta device, peft's
    wrapper added again with the model's own peft config, then loaded with ``assign=True``
    (the tensors of ``state_dict`` become the parameters); which parameters train is copied
    from ``model`` (the adapter's non-LoRA trainables are saved beside it). Buffers that are
    not saved (rotary frequencies) stay on the meta device: the copy is for saving, not computing.

    Raises:
        RuntimeError: the copy's parameter names differ from ``state_dict``'s (both named).
    """
    import copy

    import torch

    from mmtune.training.peft_setup import is_peft_model

    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    with torch.device("meta"):
        twin = original_class(base)._from_config(copy.deepcopy(base.config))
        twin.generation_config = copy.deepcopy(base.generation_config)
        # A model read with from_pretrained remembers how its checkpoint's names were mapped;
        # save_pretrained maps them back the same way (as it does for the trained model under DDP).
        if hasattr(base, "_weight_conversions"):
            twin._weight_conversions = base._weight_conversions
        if peft:
            from peft import get_peft_model

            name = model.active_adapter
            twin = get_peft_model(twin, copy.deepcopy(model.peft_config[name]), adapter_name=name)
    expected = set(twin.state_dict())
    if expected != set(state_dict):
        missing, extra = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        raise RuntimeError(f"final/: the {type(twin).__name__} rebuilt from the model's config has other "
                           f"parameters than the trained model: missing {missing[:5]}, unexpected {extra[:5]} "
                           f"({len(missing)} and {len(extra)}); the model's structure changed after it was built")
    twin.load_state_dict(state_dict, assign=True)
    if hasattr(twin, "tie_weights"):
        twin.tie_weights()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    for n, p in twin.named_parameters():
        p.requires_grad_(n in trained)
    return twin.eval()


# The registry lives beside the interface so each engine module imports only this one.
_ENGINES: dict[str, type[Engine]] = {}


def register_engine(cls: type[Engine]) -> type[Engine]:
    """Class decorator: make ``cls`` selectable as ``training.backend.engine=<cls.name>``, its
    ``settings_class`` the ``training.backend.<cls.name>`` section.

    Raises:
        ValueError: the name is registered twice, or ``settings_class`` is not a dataclass.
    """
    import dataclasses

    if not (isinstance(getattr(cls, "settings_class", None), type) and dataclasses.is_dataclass(cls.settings_class)):
        raise ValueError(f"engine {cls.__name__} has no settings_class: set it to the dataclass of its "
                         f"training.backend.{getattr(cls, 'name', '<name>')} section")
    if cls.name in _ENGINES and _ENGINES[cls.name] is not cls:
        raise ValueError(f"engine {cls.name!r} is registered twice ({_ENGINES[cls.name].__name__}, {cls.__name__})")
    _ENGINES[cls.name] = cls
    return cls

"""Typed schema of an SFT run: the top-level :class:`SFTConfig` and its training-side groups.

``configs/sft.yaml`` is validated against :class:`SFTConfig` (registered in Hydra's
ConfigStore as ``sft_schema``); each config group is one field:

======================  ==============================================  ====================
group                   schema                                          owner module
======================  ==============================================  ====================
``model/``              :class:`mmtune.models.config.ModelConfig`       models
``data/``               :class:`mmtune.data.config.DataConfig`          data layer
``collator/``           :class:`mmtune.data.collator.CollatorConfig`    collator
``training/``           :class:`TrainingConfig`                         here
``peft/``               :class:`PeftConfig`                             here
``context/``            :class:`mmtune.models.rope.ContextConfig`       models/rope.py
``logging/``            :class:`LoggingConfig`                          here
``eval/``               :class:`mmtune.evaluation.config.EvalConfig`    evaluator
======================  ==============================================  ====================

OmegaConf rejects an unknown key or a wrong type while merging (and
:func:`mmtune.schema_keys.unknown_keys` the ones Hydra's ``+key=value`` adds); :func:`validate`
then checks what types cannot say (a value from a fixed set, a file that must exist)
and raises one :class:`ConfigError` that lists every problem with its key.
"""

# No ``from __future__ import annotations``: OmegaConf reads these annotations at run time.
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from mmtune.core.sections import Sectioned, with_sections
from mmtune.data.collator import CollatorConfig
from mmtune.data.config import DataConfig
from mmtune.evaluation.config import EvalConfig
from mmtune.experiment import Recipe
from mmtune.models.config import ModelConfig
from mmtune.models.rope import ROPE_SCALINGS, ContextConfig
from mmtune.training.packed_attention import resolve_attention
from mmtune.training.sequence_parallel.config import SequenceParallelConfig, engine_problem

__all__ = [
    "ConfigError",
    "GroupConfig",
    "BackendConfig",
    "backend_config_class",
    "TrainingConfig",
    "PeftConfig",
    "LoggingConfig",
    "SyntheticDataConfig",
    "SFTConfig",
    "ContextConfig",
    "register_configs",
    "validate",
    "apply_data_files",
    "to_sft_config",
]

MIXED_PRECISION = ("no", "bf16", "fp16")
PEFT_METHODS = ("none", "lora", "qlora")
LOSS_IMPLS = ("auto", "chunked", "fused", "materialized")  # mmtune.training.loss (imports torch)
SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")


class ConfigError(ValueError):
    """An SFT config is invalid; the message lists every problem with its config key."""


@dataclass
class GroupConfig:
    """Training settings of one module group (vision tower, projector or language model)."""

    train: bool = True
    """Update this group. Under LoRA, ``true`` for the language model means its LoRA
    adapters train (the base weights stay frozen); other groups train in full."""
    lr: Optional[float] = None
    """Learning rate of this group; ``None`` uses ``training.lr``. The public MMDU
    LLaVA script trains the projector at 2e-5 while LoRA runs at 2e-4."""
    weight_decay: Optional[float] = None
    """Weight decay of this group's matrices; ``None`` uses ``training.weight_decay``.
    Norm weights and biases never decay."""


@dataclass
class BackendConfig(Sectioned):
    """``training.backend``: the distributed engine and its settings, one section per
    registered engine (``training.backend.<name>``, typed by the engine's ``settings_class``
    in its own module under :mod:`mmtune.training.engines`).

    ``BackendConfig(...)`` returns an instance of :func:`backend_config_class`: this class
    extended by one section per registered engine, as :class:`~mmtune.models.config.ModelConfig`
    holds one per model family, so an engine brings its keys without an edit here and an
    unknown key still fails at start-up.
    """

    engine: str = "ddp"
    """The registered engine that runs the job (:func:`mmtune.training.engines.engine_names`):
    ``ddp`` (full weights on every rank; one process needs no launcher) and the sharding
    engines, each with its launch in docs/training.md. A launcher that started another
    engine is refused at start-up."""

    @classmethod
    def sectioned_class(cls) -> type:
        return backend_config_class()


def engine_context(cfg: "SFTConfig") -> Any:
    """What the run's engine is told of the run beyond its own section
    (:class:`~mmtune.training.engines.base.EngineContext`)."""
    from mmtune.training.engines import EngineContext

    t = cfg.training
    return EngineContext(mixed_precision=t.mixed_precision, max_grad_norm=t.max_grad_norm, compile=t.compile,
                         trains_vision=t.vision.train, quantized_base=cfg.peft.method == "qlora",
                         sequence_parallel=t.sequence_parallel.size)


def run_engine(cfg: "SFTConfig") -> Any:
    """The engine ``training.backend.engine`` names, built from its own section and :func:`engine_context`."""
    from mmtune.training.engines import build_engine

    backend = cfg.training.backend
    return build_engine(backend.engine, getattr(backend, backend.engine), engine_context(cfg))


def _launcher_problems(cfg: "SFTConfig") -> list[str]:
    """The experiment's ``launcher`` checked against the engine ``training.backend.engine`` chooses
    (:func:`mmtune.training.launch.launcher_problem`, the one place the two are compared)."""
    from mmtune.training.launch import LaunchFileError, launcher_problem

    if not cfg.launcher:
        return []
    fix = (f"; or set launcher= to a launch file for training.backend.engine={cfg.training.backend.engine} "
           "(launch/accelerate/), or launcher=null")
    try:
        problem = launcher_problem(cfg.training.backend, cfg.launcher, origin=f"launcher={cfg.launcher}")
    except LaunchFileError as err:
        return [f"launcher={cfg.launcher}: {err}"]
    return [problem + fix] if problem else []


def backend_config_class() -> type:
    """:class:`BackendConfig` with one section per registered engine, named after it and typed
    by its ``settings_class`` (built once per set of registered engines).

    Raises:
        ValueError: an engine's name is one of the section's own keys (``engine``).
    """
    from mmtune.training.engines import settings_classes

    return with_sections(BackendConfig, settings_classes(),
                         clash="engine name(s) {names} collide with training.backend's own keys; rename the engine")


@dataclass
class TrainingConfig:
    """The ``training/`` group: optimisation, precision, checkpoints, resume."""

    output_dir: str = "outputs/sft"
    """Run directory: ``checkpoints/step-<N>/`` for resume, ``final/`` for the HF checkpoint."""
    seed: int = 42
    """Seeds python/numpy/torch at start-up and the data order."""
    epochs: int = 1
    """Passes over the data mixture (the paper trains one epoch)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (``None``: run all epochs)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (the MMDU LLaVA script uses 16 at batch 1)."""
    lr: float = 2e-5
    """Base learning rate (groups without their own ``lr`` use it)."""
    weight_decay: float = 0.0
    """AdamW weight decay for matrices (norms and biases are excluded)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    lr_scheduler: str = "cosine"
    """transformers scheduler name: cosine (paper), linear, constant, constant_with_warmup, ..."""
    warmup_ratio: float = 0.03
    """Fraction of steps with linear warm-up (0.03 as in LLaVA-1.5 and MMDU)."""
    warmup_steps: Optional[int] = None
    """Warm-up steps; overrides ``warmup_ratio`` when set."""
    max_grad_norm: Optional[float] = 1.0
    """Gradient clipping norm; ``None`` disables clipping."""
    max_nonfinite_steps: int = 0
    """Optimizer steps with a NaN / infinite loss or gradient norm tolerated before the run
    stops (exit status non-zero, naming the step and its samples' ids). 0: stop at the first.
    A tolerated step's update is skipped (DDP, FSDP2; DeepSpeed steps inside its backward),
    and nothing is saved after a non-finite step, so a good checkpoint is never replaced by a
    poisoned one. Under fp16 an infinite gradient norm with a finite loss is the loss
    scaler's skipped step and is not counted (:mod:`mmtune.training.nonfinite`)."""
    mixed_precision: str = "no"
    """``no`` (fp32), ``bf16`` (A100/H100) or ``fp16`` (older GPUs, uses loss scaling)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: ~30% slower, far less activation memory
    (needed for 8k-16k multi-image sequences on 7B models)."""
    vision: GroupConfig = field(default_factory=lambda: GroupConfig(train=False))
    """Vision tower: frozen by default, as in LLaVA-1.5 and MMDU."""
    projector: GroupConfig = field(default_factory=GroupConfig)
    """Multimodal projector."""
    language_model: GroupConfig = field(default_factory=GroupConfig)
    """Language model (including its embeddings and LM head)."""
    save_every_steps: Optional[int] = None
    """Write a resumable checkpoint every N optimizer steps (``None``: only at the end)."""
    keep_last: int = 2
    """Resumable checkpoints kept; older ones are deleted after a new one is complete."""
    resume: Optional[str] = None
    """``auto`` (latest complete checkpoint in ``output_dir``, or a fresh start), a
    checkpoint directory, or ``None`` (fresh start; fails if checkpoints exist, so a run
    is never silently overwritten)."""
    overwrite_output_dir: bool = False
    """Start afresh in a ``training.output_dir`` an earlier run used (its checkpoints,
    ``final/`` or ``metrics.jsonl``): its resumable checkpoints and per-step logs are deleted
    at start-up and ``final/`` is replaced when this run saves. Without it (and without
    ``training.resume``) such a folder is refused, naming what it holds."""
    resume_config_changes: List[str] = field(default_factory=list)
    """Config keys allowed to differ from the resumed checkpoint's config, dotted
    (``[training.lr]``; a key covers the keys under it, ``training.projector`` covers
    ``training.projector.lr``). Resuming with any other changed key that affects training
    is refused, listing each as ``key: old -> new``. An allowed change is recorded with
    the first step it applies to (``config_changes`` in later checkpoints'
    ``trainer_state.json`` and in ``final/mmtune_run.json``). Keys that never change what
    is trained (logging, eval, checkpoint cadence, caches, ...) may differ without being
    named: :data:`mmtune.training.checkpoint.RESUME_FREE_KEYS` lists them with reasons.
    A data file whose content changed under the same path is a change of
    ``data.mixture.sources[<i>].content`` (its SHA-256 and size, :mod:`mmtune.data.identity`)."""
    save_final: bool = True
    """Write ``final/`` (a normal HF checkpoint, plus the LoRA adapter for LoRA runs)."""
    num_workers: int = 0
    """DataLoader worker processes (image decoding happens in workers)."""
    log_sample_ids: bool = False
    """Append the dialogue ids of every optimizer step to ``sample_ids.jsonl`` (rank 0
    gathers all ranks): proves exact resume and no overlap between ranks."""
    backend: BackendConfig = field(default_factory=BackendConfig)
    """The distributed engine (``training.backend.engine``, a registered engine) and its settings."""
    eval_before: bool = False
    """Evaluate the ``eval`` benchmarks before training (the baseline score)."""
    eval_after: bool = False
    """Evaluate the ``eval`` benchmarks on the final checkpoint."""
    compile: bool = False
    """``torch.compile`` the model (GPU runs; adds start-up time)."""
    loss_impl: str = "auto"
    """How the loss meets the output head. ``chunked``: pure-PyTorch linear cross-entropy
    that never holds more than ``loss_chunk_size`` rows of logits (any device); ``fused``:
    Liger's fused kernel (CUDA, ``pip install 'mmtune[liger]'``); ``materialized``: full
    fp32 logits (1 GB at 8k tokens for a 32k vocabulary, 3 GB for InternLM2's 92k);
    ``auto``: ``fused`` when available, else ``chunked``."""
    loss_chunk_size: int = 1024
    """Loss rows per chunk of the ``chunked`` loss: larger is faster, smaller holds fewer
    logits (``rows x vocab`` fp32 per chunk; 1024 x 92,544 = 380 MB)."""
    packed_attention: str = "auto"
    """Attention over packed rows (``collator.batching=packing``). ``auto``: with
    ``model.attn_implementation`` sdpa or eager, each packed sample attends alone (its own
    kernel call: no ``L x L`` block mask, the cost of the samples); flash_attention_2 keeps
    its varlen kernel. ``per_sample``: the same, failing at start-up where it cannot work.
    ``off``: transformers' block-diagonal mask (every row pays ``L²`` scores)."""
    sequence_parallel: SequenceParallelConfig = field(default_factory=SequenceParallelConfig)
    """Rows split across ranks (``size`` ranks per row); see :mod:`mmtune.training.sequence_parallel`."""


@dataclass
class PeftConfig:
    """The ``peft/`` group: full fine-tuning, LoRA or QLoRA."""

    method: str = "none"
    """``none`` (full fine-tune of the trained groups), ``lora`` or ``qlora`` (4-bit base
    weights via bitsandbytes, GPU only)."""
    r: int = 8
    """LoRA rank: higher = more capacity and more memory (MMDU LLaVA script: 128)."""
    alpha: int = 16
    """LoRA alpha; the update is scaled by alpha / r (MMDU LLaVA script: 256)."""
    dropout: float = 0.05
    """Dropout on the LoRA input."""
    target_modules: Optional[List[str]] = None
    """Module names (last name component) that get LoRA inside the language model;
    ``None`` uses the adapter's ``default_lora_targets``. The vision tower and projector
    never get LoRA: they train in full or stay frozen (``training.<group>.train``)."""
    merge_on_save: bool = True
    """Also write ``final/`` as a merged HF checkpoint (LoRA folded into the weights) next
    to ``final/adapter/``, so evaluation loads it like any model."""


@dataclass
class LoggingConfig:
    """The ``logging/`` group: Weights & Biases and console progress."""

    wandb: bool = False
    """Log to Weights & Biases (``WANDB_MODE=offline`` works without a network)."""
    project: str = "mmtune"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team or user); ``None`` = your default."""
    run_name: Optional[str] = None
    """W&B run name; ``None`` = the output directory's name."""
    tags: List[str] = field(default_factory=list)
    """W&B tags."""
    mode: Optional[str] = None
    """W&B mode: ``online``, ``offline`` or ``disabled``; ``None`` = ``$WANDB_MODE`` or online."""
    every_steps: int = 1
    """Log metrics every N optimizer steps."""
    progress_bar: bool = True
    """tqdm progress bar on the main process (loss, lr, tokens/s, images/s, MFU)."""
    metrics_file: bool = True
    """Also write every logged step to ``<output_dir>/metrics.jsonl``."""


@dataclass
class SyntheticDataConfig:
    """Generate the synthetic multi-image dataset before training (the demo)."""

    enabled: bool = False
    """Run the generator into ``out_dir`` first (skipped when its files already exist)."""
    out_dir: str = "outputs/synthetic"
    """Where train/test/llava JSONs and images are written."""
    n_train: int = 512
    """Training dialogues (MMDU format)."""
    n_test: int = 64
    """Held-out dialogues (benchmark schema), scored by exact match."""
    n_llava: int = 0
    """llava-665k-shaped single-image samples."""
    seed: int = 0
    """Generator seed."""
    image_size: int = 32
    """Side of the generated images in pixels."""
    options: Dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of ``generate_synthetic`` (task difficulty)."""


@dataclass
class SFTConfig:
    """Top-level schema of ``recipes/sft.py`` (``configs/sft.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model family, checkpoint and loading options."""
    data: DataConfig = field(default_factory=DataConfig)
    """Sources and mixture."""
    collator: CollatorConfig = field(default_factory=CollatorConfig)
    """Encoding, truncation, batching and packing."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Optimisation, precision, checkpoints."""
    peft: PeftConfig = field(default_factory=PeftConfig)
    """Full fine-tune, LoRA or QLoRA."""
    context: ContextConfig = field(default_factory=ContextConfig)
    """Training window and RoPE scaling."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """W&B and console."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Benchmarks run before/after training (``training.eval_before/eval_after``)."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """Synthetic data generation (the demo)."""
    run_name: Optional[str] = None
    """Name recorded in result files and ``mmtune_run.json``; ``None`` = output dir name."""
    recipe: Recipe = Recipe.sft
    """Which recipe runs this config: ``sft`` (recipes/sft.py, ``mmtune train``) or ``evaluate``
    (recipes/evaluate.py, ``mmtune evaluate``). Evaluation experiments set ``evaluate``, and
    ``mmtune train`` refuses them, naming the command that runs them."""
    launcher: Optional[str] = None
    """The accelerate config file the experiment's command launches with (``accelerate launch
    --config_file <launcher>``), relative to the project; ``None``: one process or plain DDP.
    ``mmtune plan`` plans the run for it unless ``--accelerate-config`` gives another."""


def register_configs() -> None:
    """Register :class:`SFTConfig` as ``sft_schema`` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="sft_schema", node=SFTConfig)


def apply_data_files(cfg: Any) -> list[str]:
    """Make ``data.files`` the run's sources, in the composed config itself (so what the run
    logs and saves in ``mmtune_run.json`` is what it trains on): one source per file, its
    format detected as ``mmtune data check FILE`` does (:func:`mmtune.data.check.sources_from_files`),
    with ``data.image_root``; the data group's own sources are replaced.

    Returns:
        One line per source saying what it is and why (``[]`` without ``data.files``).

    Raises:
        ConfigError: every file that is missing or of no known format, listed.
    """
    from omegaconf import OmegaConf, open_dict

    from mmtune.data.files import sources_from_files
    from mmtune.data.config import ConfigError as DataConfigError

    files = OmegaConf.select(cfg, "data.files", default=None)
    if not files:
        return []
    files = [str(f) for f in files]
    try:
        sources, reasons = sources_from_files(
            files, OmegaConf.select(cfg, "data.image_root", default=None),
            max_record_bytes=OmegaConf.select(cfg, "data.validation.max_record_bytes", default=None))
    except DataConfigError as err:
        raise ConfigError(str(err)) from None
    ratios = list(OmegaConf.select(cfg, "data.ratios", default=None) or [])
    if ratios and len(ratios) != len(files):
        raise ConfigError(f"data.ratios has {len(ratios)} value(s) for {len(files)} data.files: give one share per "
                          "file, in the same order")
    replaced = [s.get("name") for s in (OmegaConf.select(cfg, "data.mixture.sources", default=None) or [])]
    with open_dict(cfg):
        cfg.data.mixture.sources = list(sources)
        if ratios:  # by name, as data.mixture.weights mixes any sources
            cfg.data.mixture.weights = {s.name: float(r) for s, r in zip(sources, ratios)}
        if replaced:  # the group's strategy label described its own sources
            cfg.data.mixture.strategy = "custom"
    lines = [f"data.files: {s.path} -> source {s.name!r}, format {s.format} ({why})"
             + (f", ratio {ratios[i]:g}" if ratios else "") for i, (s, why) in enumerate(zip(sources, reasons))]
    if replaced and replaced != [s.name for s in sources]:
        lines.append(f"data.files replaces the data group's sources ({', '.join(map(str, replaced))})")
    return lines


def to_sft_config(cfg: Any) -> SFTConfig:
    """Turn a composed DictConfig into an :class:`SFTConfig` object and :func:`validate` it.

    ``data.files``, when set, first becomes the config's sources (:func:`apply_data_files`,
    which updates ``cfg`` itself)."""
    from omegaconf import OmegaConf

    from mmtune.schema_keys import unknown_keys

    unknown = unknown_keys(cfg, SFTConfig)
    if unknown:  # ``+key=value`` slips past OmegaConf's struct check; a typo must not be ignored
        raise ConfigError("unknown config key(s), not in the schema (mmtune.training.config.SFTConfig):\n  - "
                          + "\n  - ".join(unknown))
    apply_data_files(cfg)
    merged = OmegaConf.merge(OmegaConf.structured(SFTConfig), cfg)
    config: SFTConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    validate(config)
    return config


def _schedule_problems(cfg: SFTConfig) -> list[str]:
    """``training``'s precision, schedule, lengths and loss."""
    problems: list[str] = []
    t = cfg.training
    if t.mixed_precision not in MIXED_PRECISION:
        problems.append(f"training.mixed_precision={t.mixed_precision!r}: use one of {', '.join(MIXED_PRECISION)}")
    if t.lr_scheduler not in SCHEDULERS:
        problems.append(f"training.lr_scheduler={t.lr_scheduler!r}: use one of {', '.join(SCHEDULERS)}")
    for key, value in (("epochs", t.epochs), ("gradient_accumulation_steps", t.gradient_accumulation_steps),
                       ("keep_last", t.keep_last)):
        if value < 1:
            problems.append(f"training.{key}={value} must be >= 1")
    if t.max_nonfinite_steps < 0:
        problems.append(f"training.max_nonfinite_steps={t.max_nonfinite_steps} must be >= 0 (0: stop at the first "
                        "non-finite step)")
    for key in ("max_steps", "save_every_steps", "warmup_steps"):
        value, least = getattr(t, key), 0 if key == "warmup_steps" else 1
        if value is not None and value < least:
            problems.append(f"training.{key}={value} must be >= {least} (or null)")
    if not 0.0 <= t.warmup_ratio < 1.0:
        problems.append(f"training.warmup_ratio={t.warmup_ratio} must be in [0, 1)")
    if t.loss_impl not in LOSS_IMPLS:
        problems.append(f"training.loss_impl={t.loss_impl!r}: use one of {', '.join(LOSS_IMPLS)}")
    if t.loss_chunk_size < 1:
        problems.append(f"training.loss_chunk_size={t.loss_chunk_size} must be >= 1")
    return problems


def _parallel_problems(cfg: SFTConfig) -> list[str]:
    """Packed attention and sequence parallelism against the model and the engine."""
    from mmtune.training.engines import engine_class, engine_names

    problems: list[str] = []
    t = cfg.training
    try:
        resolve_attention(t.packed_attention, batching=cfg.collator.batching,
                          attn_implementation=cfg.model.attn_implementation)
    except ValueError as err:
        problems.append(str(err))
    sp = t.sequence_parallel.size
    if sp < 1:
        problems.append(f"training.sequence_parallel.size={sp} must be >= 1 (1: off)")
    elif sp > 1 and cfg.model.attn_implementation not in ("sdpa", "eager"):
        problems.append(f"training.sequence_parallel.size={sp} cannot split model.attn_implementation="
                        f"{cfg.model.attn_implementation}: set model.attn_implementation=sdpa (on a GPU, sdpa's "
                        "causal kernel is FlashAttention) or eager")
    if sp > 1 and t.backend.engine in engine_names() and engine_class(t.backend.engine).sequence_parallel_problem:
        able = [name for name in engine_names() if not engine_class(name).sequence_parallel_problem]
        problems.append(engine_problem(sp, t.backend.engine, engine_class(t.backend.engine).sequence_parallel_problem,
                                       able))
    return problems


def _optimizer_problems(cfg: SFTConfig) -> list[str]:
    """The optimizer's settings, the loaders and what trains."""
    problems: list[str] = []
    t = cfg.training
    # NaN passes every comparison, so "x <= 0" alone lets it through to the first step.
    if not (math.isfinite(t.lr) and t.lr > 0):
        problems.append(f"training.lr={t.lr} must be a finite number > 0")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        problems.append(f"training.weight_decay={t.weight_decay} must be a finite number >= 0")
    for name in ("vision", "projector", "language_model"):
        group = getattr(t, name)
        if group.lr is not None and not (math.isfinite(group.lr) and group.lr > 0):
            problems.append(f"training.{name}.lr={group.lr} must be a finite number > 0 (or null for training.lr)")
        if group.weight_decay is not None and not (math.isfinite(group.weight_decay) and group.weight_decay >= 0):
            problems.append(f"training.{name}.weight_decay={group.weight_decay} must be a finite number >= 0 "
                            "(or null for training.weight_decay)")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            problems.append(f"training.{key}={getattr(t, key)} must be in [0, 1)")
    if not (math.isfinite(t.adam_epsilon) and t.adam_epsilon > 0):
        problems.append(f"training.adam_epsilon={t.adam_epsilon} must be a finite number > 0 (it keeps AdamW's "
                        "division away from zero)")
    if t.max_grad_norm is not None and not t.max_grad_norm >= 0:  # also NaN; inf measures without clipping
        problems.append(f"training.max_grad_norm={t.max_grad_norm} must be >= 0 (or null: no clipping)")
    if t.num_workers < 0:
        problems.append(f"training.num_workers={t.num_workers} must be >= 0 (0: load in the main process)")
    if not any(getattr(t, g).train for g in ("vision", "projector", "language_model")):
        problems.append("training.{vision,projector,language_model}.train are all false: nothing would train")
    return problems


def _engine_problems(cfg: SFTConfig) -> list[str]:
    """The engine ``training.backend.engine`` names: its own checks and the experiment's launcher."""
    from mmtune.training.engines import engine_class, engine_names

    problems: list[str] = []
    t = cfg.training
    if t.backend.engine not in engine_names():
        problems.append(f"training.backend.engine={t.backend.engine!r}: use one of {', '.join(engine_names())}")
    else:
        problems += engine_class(t.backend.engine).config_problems(getattr(t.backend, t.backend.engine),
                                                                   engine_context(cfg))
        problems += _launcher_problems(cfg)
    return problems


def _resume_problems(cfg: SFTConfig) -> list[str]:
    """``training.resume`` and the config changes a resume may make."""
    problems: list[str] = []
    t = cfg.training
    if t.resume not in (None, "auto") and not os.path.isdir(t.resume):
        problems.append(f"training.resume={t.resume!r} is neither 'auto' nor an existing checkpoint directory")
    if t.overwrite_output_dir and t.resume is not None:
        problems.append(f"training.overwrite_output_dir=true with training.resume={t.resume}: resuming continues "
                        "the earlier run, overwriting starts afresh; set one of them")
    if t.resume_config_changes:
        from mmtune.data.identity import content_keys
        from mmtune.schema_keys import flatten_config, key_covers

        # and each source's file content, which checkpoints record beside the config (data/identity.py)
        keys = [*flatten_config(dataclasses.asdict(cfg)), *content_keys(cfg.data.mixture.sources)]
        for entry in t.resume_config_changes:
            if not any(key_covers(entry, key) for key in keys):
                problems.append(f"training.resume_config_changes: {entry!r} names no config key (write dotted keys "
                                "such as training.lr or data.mixture.sources[0].path)")
    return problems


def _peft_problems(cfg: SFTConfig) -> list[str]:
    """The ``peft`` section."""
    problems: list[str] = []
    p = cfg.peft
    if p.method not in PEFT_METHODS:
        problems.append(f"peft.method={p.method!r}: use one of {', '.join(PEFT_METHODS)}")
    if p.method != "none":
        if p.r < 1:
            problems.append(f"peft.r={p.r} must be >= 1")
        if not 0.0 <= p.dropout < 1.0:
            problems.append(f"peft.dropout={p.dropout} must be in [0, 1)")
        if p.alpha <= 0:
            problems.append(f"peft.alpha={p.alpha} must be > 0 (the LoRA update is scaled by alpha / r)")
    if p.method == "qlora" and cfg.model.path is None:
        problems.append("peft.method=qlora needs model.path (a checkpoint to quantize); random-weight models "
                        "train with peft.method=lora or none")
    return problems


def _context_problems(cfg: SFTConfig) -> list[str]:
    """The ``context`` section."""
    problems: list[str] = []
    c = cfg.context
    if c.rope_scaling not in ROPE_SCALINGS:
        problems.append(f"context.rope_scaling={c.rope_scaling!r}: use one of {', '.join(ROPE_SCALINGS)}")
    if c.max_length is not None and c.max_length < 16:
        problems.append(f"context.max_length={c.max_length} is too small (>= 16)")
    if c.original_max_position_embeddings is not None and c.original_max_position_embeddings < 1:
        problems.append(f"context.original_max_position_embeddings={c.original_max_position_embeddings} must be >= 1")
    for key in ("yarn_beta_fast", "yarn_beta_slow"):
        value = getattr(c, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            problems.append(f"context.{key}={value} must be a finite number > 0 (or null for the default)")
    return problems


def _section_problems(cfg: SFTConfig) -> list[str]:
    """Logging, and the sections that validate themselves (model, data, collator, eval)."""
    problems: list[str] = []
    t = cfg.training
    if cfg.logging.mode not in (None, "online", "offline", "disabled"):
        problems.append(f"logging.mode={cfg.logging.mode!r}: use online, offline, disabled or null")
    if cfg.logging.every_steps < 1:
        problems.append(f"logging.every_steps={cfg.logging.every_steps} must be >= 1")
    checks = [cfg.model.validate, cfg.data.validate, cfg.collator.validate]
    if t.eval_before or t.eval_after:
        from mmtune.evaluation.config import validate_eval_config

        checks.append(lambda: validate_eval_config(cfg.eval))
    for check in checks:
        try:
            check()
        except ValueError as err:
            problems.append(str(err))
    return problems


def validate(cfg: SFTConfig) -> None:
    """Check what OmegaConf's typing cannot; raise one :class:`ConfigError` listing every problem."""
    problems: list[str] = []
    for check in (_schedule_problems, _parallel_problems, _optimizer_problems, _engine_problems, _resume_problems,
                  _peft_problems, _context_problems, _section_problems):
        problems += check(cfg)
    if problems:
        raise ConfigError("invalid SFT config:\n  - " + "\n  - ".join(problems))

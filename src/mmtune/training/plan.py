"""``mmtune plan``: resolve a run (or a whole sweep) and estimate its cost, without loading weights.

For each run it prints the model and its parameter counts (the model is built on the
``meta`` device from its config, so no weight is read and no memory is used), the data
sources with their record counts and validation report, the mixture, the context
window and RoPE scaling, LoRA or full fine-tuning, the ZeRO stage, the number of
optimizer steps, the estimated training tokens, and GPU-hours and memory per GPU for a
chosen GPU type. It fails early (exit code 1, with the data layer's report) when a data
file is missing or records would be skipped for missing or broken images.

Examples::

    mmtune plan experiment=table5_mmdu45k_8k --gpus 8 --gpu a100-80g
    mmtune plan --sweep launch/sweeps/table5.yaml --gpu h100
    mmtune plan --sweep launch/sweeps/table5.yaml --list      # one override line per run

Cost model (stated in the output as well; see :func:`estimate_cost`):

- **Compute.** Per training token the language model (``N_lm`` parameters) costs
  ``2·N_lm`` FLOPs forward, ``2·N_lm`` backward for activation gradients and
  ``2·N_trainable_lm`` backward for weight gradients (so ``6·N`` for full fine-tuning,
  about ``4·N`` for LoRA), ``+2·N_lm`` with gradient checkpointing (recomputed
  forward), plus causal attention ``6·L·d·s̄`` (``s̄`` = mean sample length; ×4/3 with
  checkpointing). The vision tower runs forward only when frozen: ``2·N_vision`` per
  image patch. ``GPU-hours = FLOPs / (peak_bf16_flops · utilization) / 3600`` with
  ``utilization`` an assumption (default 0.35, ``--utilization``).
- **Memory per GPU.** Weights (``bytes(dtype)·N``), gradients (``bytes(dtype)·N_trainable``)
  and AdamW states (``8·N_trainable`` for m and v in fp32, ``+4·N_trainable`` for the fp32
  master copy when weights are 16-bit), divided by the data-parallel size as the ZeRO
  stage shards them (1: optimizer states; 2: +gradients; 3: +weights; offloaded parts
  count 0); under ZeRO-3 each GPU also holds the gathered working set of
  ``stage3_max_live_parameters`` (1e9 by default) parameters. Activations (16-bit,
  FlashAttention/SDPA so no ``s²`` score matrix): ``34·s·d``
  bytes per layer for ``s`` tokens in a micro-batch (Korthikanti et al., 2022); with
  gradient checkpointing ``2·s·d`` per layer plus one layer's ``34·s·d``. Logits:
  the loss's working memory per ``training.loss_impl`` (materialised ``14·s·V`` bytes; the
  chunked and fused linear cross-entropy hold one chunk of logits: see
  :func:`estimate_cost`). Plus 1.5 GiB for the CUDA context
  and allocator slack.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.data.batching import steps_per_epoch

__all__ = [
    "GPU_TYPES",
    "GpuType",
    "ParamCounts",
    "DataPlan",
    "CostEstimate",
    "RunPlan",
    "PlanError",
    "compose_run",
    "sweep_grid",
    "sweep_accelerate_config",
    "sweep_recipe",
    "experiment_recipe",
    "plan_evaluation",
    "EvalPlan",
    "count_parameters",
    "estimate_cost",
    "plan_run",
    "main",
]


class PlanError(RuntimeError):
    """A run cannot start as configured; the message lists every problem."""


@dataclass(frozen=True)
class GpuType:
    name: str
    peak_tflops: float
    """Dense bf16 tensor-core peak (no sparsity), TFLOP/s."""
    memory_gib: float
    hbm_tbps: float
    """Memory bandwidth, TB/s (bounds greedy decoding speed)."""


# Vendor datasheet numbers (dense bf16, without the 2:4 sparsity doubling).
GPU_TYPES: dict[str, GpuType] = {
    "a100-40g": GpuType("A100-SXM4-40GB", 312.0, 40.0, 1.555),
    "a100-80g": GpuType("A100-SXM4-80GB", 312.0, 80.0, 2.039),
    "h100": GpuType("H100-SXM5-80GB", 989.0, 80.0, 3.35),
    "h200": GpuType("H200-SXM-141GB", 989.0, 141.0, 4.8),
    "l40s": GpuType("L40S-48GB", 362.0, 48.0, 0.864),
    "a10g": GpuType("A10G-24GB", 70.0, 24.0, 0.6),
    "rtx4090": GpuType("RTX 4090-24GB", 165.0, 24.0, 1.008),
}

# Architectures of public checkpoints the shipped configs name by hub id, so `plan`
# counts parameters without network access or a download. A local checkpoint directory
# (or the hub cache) always wins over this table.
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llava-hf/llava-1.5-7b-hf": {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                          "patch_size": 14, "projection_dim": 768},
        "vision_feature_layer": -2,
        "image_token_index": 32000,
    },
    "llava-hf/llava-1.5-13b-hf": {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                          "patch_size": 14, "projection_dim": 768},
        "vision_feature_layer": -2,
        "image_token_index": 32000,
    },
    # The official remote-code config of the VL variant (490 px, 1225 image tokens).
    "internlm/internlm-xcomposer2-vl-7b": {
        "model_type": "internlmxcomposer2", "vocab_size": 92544, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
        "rope_scaling": {"type": "dynamic", "factor": 1.0}, "img_size": 490,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
}

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_OVERHEAD_GIB = 1.5
ZERO3_LIVE_PARAMETERS = 1_000_000_000


# ----------------------------------------------------------------------------- configs


def _configs_dir() -> Path:
    from mmtune.data.config import configs_dir

    return configs_dir()


RECIPES = {"sft": "recipes/sft.py", "evaluate": "recipes/evaluate.py"}


def compose_run(overrides: Sequence[str], config_name: str = "sft") -> Any:
    """Compose ``configs/<config_name>.yaml`` with Hydra overrides (the recipe's view).

    ``config_name`` is ``sft`` (recipes/sft.py) or ``evaluate`` (recipes/evaluate.py,
    whose primary config has no ``experiment`` default: ``experiment=x`` is passed on
    as ``+experiment=x``). Returns the composed ``DictConfig`` (interpolations unresolved).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from mmtune.evaluation.config import register_configs as register_eval
    from mmtune.training.config import register_configs

    register_configs()
    register_eval()
    if config_name == "evaluate":
        overrides = [f"+{o}" if o.startswith("experiment=") else o for o in overrides]
    else:
        overrides = [o[1:] if o.startswith("+experiment=") else o for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(_configs_dir().resolve()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def sweep_grid(sweep: dict[str, Any] | str | os.PathLike) -> list[list[str]]:
    """Every grid point of a W&B sweep file as a list of Hydra overrides.

    ``parameters`` entries with ``values`` are crossed (W&B's ``grid`` method); entries
    with ``value`` are fixed. Keys are Hydra override keys (``experiment``,
    ``training.lr``, ``+x``); order follows the file.
    """
    if not isinstance(sweep, dict):
        from omegaconf import OmegaConf

        sweep = OmegaConf.to_container(OmegaConf.load(sweep), resolve=False)  # type: ignore[assignment]
    params = sweep.get("parameters") or {}
    if not params:
        raise ValueError("sweep has no `parameters`; a sweep must grid over at least `experiment`")
    method = sweep.get("method", "grid")
    if method != "grid":
        raise ValueError(f"sweep method {method!r}: mmtune's sweeps are grids over table rows (method: grid)")
    axes: list[list[str]] = []
    for key, spec in params.items():
        if not isinstance(spec, dict) or ("values" not in spec and "value" not in spec):
            raise ValueError(f"sweep parameter {key!r} needs `values: [...]` or `value: x`")
        values = spec["values"] if "values" in spec else [spec["value"]]
        axes.append([f"{key}={_override_value(v)}" for v in values])
    return [list(point) for point in itertools.product(*axes)]


def sweep_recipe(sweep: str | os.PathLike) -> str:
    """``sft`` or ``evaluate``: which recipe a sweep's ``program`` runs."""
    from omegaconf import OmegaConf

    program = str(OmegaConf.load(sweep).get("program") or "")
    for name, path in RECIPES.items():
        if program == path:
            return name
    raise ValueError(f"program {program!r} is not one of {sorted(RECIPES.values())}")


def experiment_recipe(overrides: Sequence[str]) -> str:
    """The recipe an ``experiment=`` override's file names in its leading command comment
    (every experiment file starts with the command that runs it); ``sft`` if none."""
    for o in overrides:
        key, _, name = o.partition("=")
        if key.lstrip("+") != "experiment" or not name:
            continue
        path = _configs_dir() / "experiment" / f"{name}.yaml"
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.startswith("#"):
                    break
                for recipe, script in RECIPES.items():
                    if script in line:
                        return recipe
    return "sft"


def sweep_accelerate_config(sweep: str | os.PathLike) -> Optional[str]:
    """The ``--config_file`` an accelerate-launched sweep command passes, if any."""
    from omegaconf import OmegaConf

    command = [str(c) for c in (OmegaConf.to_container(OmegaConf.load(sweep), resolve=False).get("command") or [])]
    if "--config_file" in command[:-1]:
        return command[command.index("--config_file") + 1]
    return None


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


# ----------------------------------------------------------------------------- model


@dataclass
class ParamCounts:
    total: int
    vision: int
    projector: int
    language_model: int
    trainable: int
    """Parameters updated by the optimizer (LoRA adapters + fully trained groups)."""
    trainable_language_model: int
    """Trainable parameters inside the language model (LoRA weights under LoRA)."""
    lora: int
    """LoRA adapter parameters (0 for full fine-tuning)."""
    hidden_size: int
    num_layers: int
    vocab_size: int
    image_tokens: Optional[int]
    """Tokens per image, when the config says (patches of a square image)."""
    source: str
    """How the counts were obtained: meta-device build from which config."""


def _model_config_dict(model_cfg: Any) -> tuple[Optional[dict[str, Any]], str]:
    """The checkpoint's config.json as a dict, or a known architecture; (None, why) otherwise."""
    path = model_cfg.path
    if path is None:
        return None, "random-weight architecture from the model config"
    local = Path(os.path.expanduser(path)) / "config.json"
    if local.is_file():
        return json.loads(local.read_text(encoding="utf-8")), f"{local}"
    if path in KNOWN_ARCHITECTURES:
        return copy.deepcopy(KNOWN_ARCHITECTURES[path]), f"published architecture of {path}"
    try:  # the hub cache (works offline when the checkpoint was downloaded before)
        from huggingface_hub import hf_hub_download

        cached = hf_hub_download(path, "config.json", local_files_only=True)
        return json.loads(Path(cached).read_text(encoding="utf-8")), cached
    except Exception:  # noqa: BLE001 - any failure means "not available offline"
        return None, (f"model.path={path!r} has no config.json locally and is not a known architecture; "
                      "download the checkpoint or point model.path at a local directory")


def _meta_model(model_cfg: Any):
    """Build the model on the meta device (no weights read, no memory).

    Returns ``(model, source, groups)``: ``groups`` is the family's
    :class:`~mmtune.models.base.ModuleGroups` split of the model.
    """
    import torch

    # Every tensor is created on the meta device: no allocation and no initialisation
    # (accelerate's init_empty_weights still initialises on the CPU first: ~40x slower).
    init_empty_weights = lambda: torch.device("meta")  # noqa: E731

    config_dict, source = _model_config_dict(model_cfg)
    if model_cfg.path is None:
        from mmtune.models.registry import build_adapter

        adapter = build_adapter(model_cfg)
        with init_empty_weights():
            model = adapter.load_model()
        return model, source, adapter.module_groups(model)
    if config_dict is None:
        raise PlanError(source)
    if model_cfg.family == "internlm_xcomposer2":
        from mmtune.models import internlm_xcomposer2 as xc2
        from mmtune.models.base import ModuleGroups

        if config_dict.get("model_type") == xc2.InternLMXComposer2Config.model_type:
            config = xc2.InternLMXComposer2Config.from_dict(config_dict)
        else:  # the official remote-code config; Partial LoRA rank 256 as in the released weights
            config = xc2.native_config_from_official(config_dict, image_size=model_cfg.image_size, plora_r=256)
        with init_empty_weights():
            model = xc2.InternLMXComposer2ForCausalLM(config)
        return model, source, ModuleGroups(vision=[model.vit], projector=[model.vision_proj],
                                           language_model=[model.model, model.output])
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    with init_empty_weights():
        if model_cfg.family == "llava":
            model = transformers.LlavaForConditionalGeneration._from_config(config)
        else:
            model = transformers.AutoModelForImageTextToText.from_config(config)
    return model, source, _default_groups(model)


def count_parameters(model_cfg: Any, peft_cfg: Any, training_cfg: Any) -> ParamCounts:
    """Parameter counts per module group and what trains, from the config alone."""
    from mmtune.models.registry import adapter_class

    model, source, groups = _meta_model(model_cfg)

    def n(modules) -> int:
        seen: set[int] = set()
        total = 0
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return total

    vision, projector, lm = n(groups.vision), n(groups.projector), n(groups.language_model)
    total = sum(p.numel() for p in model.parameters())
    text = _text_config(model.config)
    hidden = int(getattr(text, "hidden_size"))
    layers = int(getattr(text, "num_hidden_layers"))
    vocab = int(getattr(text, "vocab_size"))
    lora = 0
    if peft_cfg.method in ("lora", "qlora"):
        targets = set(peft_cfg.target_modules or getattr(adapter_class(model_cfg.family), "default_lora_targets", []))
        lora = _lora_params(groups.language_model, targets, peft_cfg.r)
    t = training_cfg
    trainable_lm = (lora if peft_cfg.method != "none" else lm) if t.language_model.train else 0
    trainable = trainable_lm + (vision if t.vision.train else 0) + (projector if t.projector.train else 0)
    vc = getattr(model.config, "vision_config", None)
    image_tokens = None
    if vc is not None and getattr(vc, "image_size", None) and getattr(vc, "patch_size", None):
        image_tokens = (int(vc.image_size) // int(vc.patch_size)) ** 2
    return ParamCounts(total + lora, vision, projector, lm, trainable, trainable_lm, lora, hidden, layers, vocab,
                       image_tokens, source)


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or getattr(config, "llm_config", None) or config


def _default_groups(model: Any):
    """Groups of a transformers image-text model built without an adapter (LLaVA layout:
    ``vision_tower`` / ``multi_modal_projector`` / ``language_model`` + ``lm_head``)."""
    from mmtune.models.base import ModuleGroups

    inner = getattr(model, "model", model)
    vision = [m for m in (getattr(inner, "vision_tower", None), getattr(inner, "visual", None)) if m is not None]
    projector = [m for m in (getattr(inner, "multi_modal_projector", None),) if m is not None]
    taken = {id(p) for m in vision + projector for p in m.parameters()}

    class _Rest:  # every other parameter belongs to the language model
        def parameters(self):
            return (p for p in model.parameters() if id(p) not in taken)

        def named_modules(self):
            return ((n, m) for n, m in model.named_modules()
                    if not any(n.startswith(x) for x in ("model.vision_tower", "model.visual", "model.multi_modal_projector")))

    return ModuleGroups(vision=vision, projector=projector, language_model=[_Rest()])


def _lora_params(modules: Sequence[Any], targets: set[str], r: int) -> int:
    from torch import nn

    total = 0
    for root in modules:
        for name, m in root.named_modules():
            if name.rsplit(".", 1)[-1] in targets and isinstance(m, nn.Linear):
                total += r * (m.in_features + m.out_features)
    return total


# ----------------------------------------------------------------------------- data


@dataclass
class SourcePlan:
    name: str
    path: str
    format: str
    records: int
    kept: int
    used_per_epoch: int
    images: int
    estimated_tokens: int
    """Estimated tokens of the records used per epoch (data layer's estimate)."""
    report: str


@dataclass
class DataPlan:
    sources: list[SourcePlan]
    strategy: str
    by: str
    weights: Optional[dict[str, float]]
    samples_per_epoch: int
    tokens_per_epoch: int
    images_per_epoch: int
    mean_tokens_per_sample: float
    tokens_source: str
    notes: list[str] = field(default_factory=list)
    """Caveats of the estimate and sources with skipped records (with their reports)."""


def plan_data(data_cfg: Any, tokens_per_image: Optional[int], *, max_length: Optional[int] = None,
              allow_skipped: bool = False) -> DataPlan:
    """Load every source through the data layer (validated, cached) and size one epoch.

    Tokens come from the data layer's estimate (characters / 4 + tokens per image),
    capped at ``max_length`` per sample (the collator drops whole trailing turns past
    it); records per source and epoch come from the data layer's
    :func:`~mmtune.data.mixture.mixture_counts`, as the training sampler draws them.
    """
    import numpy as np

    from mmtune.data.readers import load_source
    from mmtune.data.validation import DataValidationError

    problems: list[str] = []
    loaded = []
    v = data_cfg.validation
    for s in data_cfg.mixture.sources:
        try:
            loaded.append(load_source(s, mode=v.mode, cache_dir=data_cfg.cache_dir, check_images=v.check_images,
                                      max_examples=v.max_examples))
        except (FileNotFoundError, DataValidationError) as err:
            problems.append(f"data source {s.name!r}: {err}")
    if problems:
        raise PlanError("\n".join(problems))
    for sd in loaded:
        bad_images = {k: n for k, n in sd.report.skipped.items() if k in ("missing_image", "corrupt_image")}
        if bad_images and not allow_skipped:
            problems.append(
                f"data source {sd.name!r}: {sum(bad_images.values())} record(s) would be skipped for "
                f"missing or broken images\n{sd.report.render()}"
            )
    if problems:
        raise PlanError("\n".join(problems) + "\n(fix the paths, or pass --allow-skipped to plan anyway)")

    from mmtune.data.mixture import mixture_counts

    mix = data_cfg.mixture
    tpi = mix.tokens_per_image if tokens_per_image is None else tokens_per_image
    per_source = []
    raw_means = []
    for sd in loaded:
        raw = sd.estimated_tokens(tpi)
        tokens = np.minimum(raw, max_length) if max_length else raw
        per_source.append((sd, len(sd), int(tokens.sum()), int(sd.num_images.sum())))
        raw_means.append(float(raw.mean()) if len(sd) else 0.0)
    # Records per source and epoch exactly as the training sampler draws them.
    try:
        counts = mixture_counts(mix, [size for _, size, _, _ in per_source], raw_means)
    except ValueError as err:
        raise PlanError(f"data.mixture: {err}") from err
    used = {sd.name: c for (sd, *_), c in zip(per_source, counts)}

    notes = []
    if data_cfg.stacking.enabled:
        notes.append("data.stacking is enabled: counts are before stacking (fewer, longer samples in training)")
    notes += [f"source {sd.name!r} skips {sd.report.records_skipped} record(s):\n{sd.report.render()}"
              for sd in loaded if sd.report.records_skipped]
    sources = []
    tokens_epoch = 0
    images_epoch = 0
    for sd, size, tok, img in per_source:
        u = used[sd.name]
        frac = u / size if size else 0.0
        tokens_epoch += int(round(tok * frac))
        images_epoch += int(round(img * frac))
        sources.append(SourcePlan(sd.name, sd.config.path, sd.config.format, sd.report.records_read, size, u, img,
                                  int(round(tok * frac)), sd.report.render()))
    samples = sum(used.values())
    return DataPlan(
        sources=sources,
        strategy=mix.strategy,
        by=mix.by,
        weights=dict(mix.weights) if mix.weights else None,
        samples_per_epoch=samples,
        tokens_per_epoch=tokens_epoch,
        images_per_epoch=images_epoch,
        mean_tokens_per_sample=tokens_epoch / samples if samples else 0.0,
        tokens_source=f"data layer estimate: characters/4 + {tpi} tokens per image"
        + (f", capped at {max_length} per sample" if max_length else ""),
        notes=notes,
    )


# ----------------------------------------------------------------------------- cost


@dataclass
class CostEstimate:
    gpu: str
    num_gpus: int
    utilization: float
    zero_stage: int
    offload_optimizer: bool
    offload_params: bool
    optimizer_steps: int
    train_tokens: int
    micro_batch_tokens: int
    flops: float
    gpu_hours: float
    wall_hours: float
    memory_gib: dict[str, float]
    fits: bool
    formula: str


def estimate_cost(
    params: ParamCounts,
    *,
    train_tokens: int,
    train_images: int,
    mean_sample_tokens: float,
    micro_batch_tokens: int,
    optimizer_steps: int,
    weight_dtype: str,
    gradient_checkpointing: bool,
    zero_stage: int,
    offload_optimizer: bool,
    offload_params: bool,
    num_gpus: int,
    gpu: GpuType,
    utilization: float,
    vision_trains: bool = False,
    loss_impl: str = "materialized",
    loss_chunk_size: int = 1024,
    head_trains: bool = True,
) -> CostEstimate:
    """Compute and memory estimate (formulas in the module docstring).

    ``loss_impl`` (``training.loss_impl``; ``auto`` counts as ``fused`` when Liger is
    installed, else ``chunked``) decides the logits term, the loss's peak working memory
    at the start of the backward pass for a micro-batch of ``s`` tokens:

    * ``materialized``: ``14·s·V`` B (16-bit logits, their fp32 copy, the fp32
      log-softmax kept for backward, and its fp32 gradient in backward);
    * ``chunked``: ``10·c·V`` B for one chunk of ``c = min(s, loss_chunk_size)`` rows
      (fp32 logits, turned into their gradient in place, plus a 16-bit copy and the
      chunk's 16-bit weight gradient ``2·V·d``), plus ``4·V·d`` for the fp32
      weight-gradient accumulator when the head trains in 16-bit;
    * ``fused`` (Liger): ``2·c·V`` B with Liger's chunk ``c = 2^ceil(log2(s / ceil(V/d)))``
      plus the gradients it computes in the forward pass and holds until backward,
      ``2·s·d + 4·V·d`` B.
    """
    n_lm, n_train_lm = params.language_model, params.trainable_language_model
    d, L, V = params.hidden_size, params.num_layers, params.vocab_size
    per_token = 2 * n_lm + 2 * n_lm + 2 * n_train_lm
    attn = 6 * L * d * mean_sample_tokens
    if gradient_checkpointing:
        per_token += 2 * n_lm
        attn *= 4 / 3
    patches = (params.image_tokens or 0) * train_images
    vision = (6 if vision_trains else 2) * params.vision * patches
    flops = train_tokens * (per_token + attn) + vision
    gpu_seconds = flops / (gpu.peak_tflops * 1e12 * utilization)
    gpu_hours = gpu_seconds / 3600

    wbytes = _DTYPE_BYTES.get(weight_dtype, 4)
    G = max(1, num_gpus)
    weights = wbytes * params.total
    grads = wbytes * params.trainable
    optim = (8 + (4 if wbytes < 4 else 0)) * params.trainable
    if zero_stage >= 1:
        optim /= G
    if zero_stage >= 2:
        grads /= G
    if zero_stage >= 3:
        weights /= G
    if offload_optimizer:
        optim = 0.0
    if offload_params and zero_stage >= 3:
        weights = 0.0
    # ZeRO-3 gathers the layers it is computing (DeepSpeed's stage3_max_live_parameters,
    # 1e9 by default): that working set sits on every GPU on top of the shards.
    gathered = wbytes * min(params.total, ZERO3_LIVE_PARAMETERS) if zero_stage >= 3 else 0.0
    s = micro_batch_tokens
    act = (2 * s * d * L + 34 * s * d) if gradient_checkpointing else 34 * s * d * L
    if loss_impl == "auto":
        import importlib.util

        loss_impl = "fused" if importlib.util.find_spec("liger_kernel") is not None else "chunked"
    head_grad_fp32 = 4 * V * d if head_trains and wbytes < 4 else 0
    if loss_impl == "chunked":
        c = min(s, max(1, loss_chunk_size))
        logits = 10 * c * V + 2 * V * d + head_grad_fp32
    elif loss_impl == "fused":
        c = min(s, 2 ** math.ceil(math.log2(max(1.0, s / math.ceil(V / d)))))
        logits = 2 * c * V + 2 * s * d + (4 * V * d if head_trains else 0)
    else:
        logits = 14 * s * V
    gib = 1024**3
    mem = {
        "weights": weights / gib,
        "zero3_gathered": gathered / gib,
        "gradients": grads / gib,
        "optimizer": optim / gib,
        "activations": act / gib,
        "logits": logits / gib,
        "overhead": _OVERHEAD_GIB,
    }
    mem["total"] = sum(mem.values())
    formula = (
        "FLOPs = tokens·(4·N_lm + 2·N_trainable_lm [+2·N_lm ckpt] + 6·L·d·s̄ [×4/3 ckpt]) + "
        "(2|6)·N_vision·patches; GPU-h = FLOPs / (peak·utilization) / 3600. "
        "Memory = weights + grads + AdamW (8 or 12 B/param) sharded by ZeRO stage (+1e9 gathered params "
        "under ZeRO-3) + activations "
        "(34·s·d·L B, or 2·s·d·L + 34·s·d with ckpt) + logits/loss term (training.loss_impl=" + loss_impl + ": "
        + {"chunked": "10·c·V + 2·V·d [+4·V·d fp32 head grad] B, c = loss_chunk_size rows",
           "fused": "2·c·V + 2·s·d + 4·V·d B, c = Liger's chunk"}.get(loss_impl, "14·s·V B") + ") + 1.5 GiB."
    )
    return CostEstimate(
        gpu=gpu.name, num_gpus=G, utilization=utilization, zero_stage=zero_stage,
        offload_optimizer=offload_optimizer, offload_params=offload_params, optimizer_steps=optimizer_steps,
        train_tokens=train_tokens, micro_batch_tokens=s, flops=flops, gpu_hours=gpu_hours,
        wall_hours=gpu_hours / G, memory_gib=mem, fits=mem["total"] <= gpu.memory_gib, formula=formula,
    )


def _zero_settings(training_cfg: Any, accelerate_config: Optional[str]) -> tuple[int, bool, bool, str]:
    """ZeRO stage and offload from the DeepSpeed JSON (training config or accelerate config)."""
    ds_path = training_cfg.deepspeed_config
    origin = "training.deepspeed_config"
    if accelerate_config:
        from omegaconf import OmegaConf

        acc = OmegaConf.to_container(OmegaConf.load(accelerate_config))
        ds = (acc or {}).get("deepspeed_config") or {}
        if ds.get("deepspeed_config_file"):
            ds_path = ds["deepspeed_config_file"]
            origin = f"{accelerate_config} -> {ds_path}"
        elif ds:
            return (int(ds.get("zero_stage", 0)), ds.get("offload_optimizer_device", "none") not in (None, "none"),
                    ds.get("offload_param_device", "none") not in (None, "none"), accelerate_config)
        else:
            return 0, False, False, f"{accelerate_config} (no DeepSpeed: DDP)"
    if not ds_path:
        return 0, False, False, "no DeepSpeed config: DDP (pass --accelerate-config to plan a ZeRO launch)"
    if not os.path.isfile(ds_path):
        raise PlanError(f"DeepSpeed config {ds_path!r} ({origin}) does not exist")
    zero = json.loads(Path(ds_path).read_text()).get("zero_optimization", {})

    def off(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")) not in ("none", "None")

    return int(zero.get("stage", 0)), off("offload_optimizer"), off("offload_param"), origin


# ----------------------------------------------------------------------------- the plan


@dataclass
class RunPlan:
    overrides: list[str]
    run_name: Optional[str]
    output_dir: str
    model: dict[str, Any]
    params: Optional[dict[str, Any]]
    data: Optional[dict[str, Any]]
    context: dict[str, Any]
    peft: dict[str, Any]
    batching: dict[str, Any]
    attention: str
    """What the language model's attention runs while training (``training.packed_attention``)."""
    zero: dict[str, Any]
    cost: Optional[dict[str, Any]]
    evaluation: dict[str, Any]

    def render(self) -> str:
        lines = [f"== run {self.run_name or '(unnamed)'}  [{' '.join(self.overrides)}]",
                 f"  output      {self.output_dir}"]
        m = self.model
        lines.append(f"  model       {m['family']}  path={m['path']}  dtype={m['torch_dtype']}")
        if self.params:
            p = self.params
            lines.append(
                f"  parameters  total {_h(p['total'])} (vision {_h(p['vision'])}, projector {_h(p['projector'])}, "
                f"language model {_h(p['language_model'])}); trainable {_h(p['trainable'])}"
                + (f" incl. LoRA {_h(p['lora'])}" if p["lora"] else "")
                + f"  [{p['source']}]"
            )
        c = self.context
        window = c["max_length"] or (f"{c['original']} (the model's own)" if c.get("original") else "the model's own")
        lines.append(f"  context     window {window}; " + (f"RoPE {c['rope_scaling']} x{c['factor']:g} from {c['original']}"
                                                            if c.get("factor") and c["factor"] > 1 else "RoPE unchanged"))
        pe = self.peft
        lines.append("  mode        " + ("full fine-tune" if pe["method"] == "none" else
                                          f"{pe['method']} r={pe['r']} alpha={pe['alpha']} dropout={pe['dropout']}")
                     + f"; train vision={pe['train_vision']} projector={pe['train_projector']} "
                     f"language_model={pe['train_language_model']}")
        if self.data:
            d = self.data
            lines.append(f"  data        strategy {d['strategy']}, mixture by {d['by']}"
                         + (f", weights {d['weights']}" if d["weights"] else ""))
            for s in d["sources"]:
                lines.append(f"    - {s['name']:<16} {s['format']:<8} kept {s['kept']:>9,} of {s['records']:>9,}; "
                             f"used/epoch {s['used_per_epoch']:>9,}; ~{_h(s['estimated_tokens'])} tokens  {s['path']}")
            lines.append(f"  epoch       {d['samples_per_epoch']:,} samples, ~{_h(d['tokens_per_epoch'])} tokens "
                         f"(mean {d['mean_tokens_per_sample']:.0f}/sample; {d['tokens_source']})")
            lines += ["  note        " + n.replace("\n", "\n              ") for n in d["notes"]]
        b = self.batching
        lines.append(f"  batching    {b['description']}")
        lines.append(f"  attention   {self.attention}")
        z = self.zero
        lines.append(f"  distributed {z['num_gpus']} GPU(s), ZeRO stage {z['stage']}"
                     + (" + optimizer offload" if z["offload_optimizer"] else "")
                     + (" + parameter offload" if z["offload_params"] else "") + f"  [{z['origin']}]")
        if self.cost:
            k = self.cost
            lines.append(f"  steps       {k['optimizer_steps']:,} optimizer steps, ~{_h(k['train_tokens'])} training tokens")
            lines.append(f"  compute     ~{k['flops']:.3g} FLOPs = {k['gpu_hours']:.3g} GPU-hours on {k['gpu']} at "
                         f"{k['utilization']:.0%} utilization ({k['wall_hours']:.3g} h wall on {k['num_gpus']})")
            mem = k["memory_gib"]
            lines.append("  memory/GPU  " + ", ".join(f"{key} {val:.1f}" for key, val in mem.items() if key != "total")
                         + f" => {mem['total']:.1f} GiB " + ("(fits)" if k["fits"] else "(DOES NOT FIT)"))
        e = self.evaluation
        if e["benchmarks"]:
            lines.append(f"  evaluation  {', '.join(e['benchmarks'])} at window {e['context_length'] or 'model default'}"
                         + (" before training" if e["before"] else "") + (" after training" if e["after"] else ""))
        return "\n".join(lines)


def _h(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def _batching(cfg: Any, data: Optional[DataPlan], num_gpus: int, window: int) -> tuple[dict[str, Any], int, int]:
    """(description, optimizer steps, tokens per micro-batch) from the collator config.

    Micro-batches per epoch: ``samples / batch_size`` for padding batches; for packing
    and token budgets, ``tokens / row capacity`` (a lower bound: packing reaches ~98%
    fill, budgets less). Steps follow from them with the training loop's own
    :func:`~mmtune.data.batching.steps_per_epoch` (a partial last step per epoch counts).
    Tokens per micro-batch (for memory) is the worst case the collator allows.
    """
    col = cfg.collator
    max_len = window
    accum = cfg.training.gradient_accumulation_steps
    epochs = cfg.training.epochs
    if col.batching == "packing":
        tokens_per_micro = col.batch_size * max_len
        desc = f"packing {col.batch_size} row(s) of {max_len} tokens per micro-batch"
        micro = math.ceil(data.tokens_per_epoch / tokens_per_micro) if data else 0
    elif col.batching == "token_budget":
        tokens_per_micro = int(col.max_tokens_per_batch or col.batch_size * max_len)
        desc = f"token budget {tokens_per_micro} padded tokens per micro-batch"
        micro = math.ceil(data.tokens_per_epoch / tokens_per_micro) if data else 0
    else:
        tokens_per_micro = col.batch_size * max_len
        desc = f"{col.batching}: {col.batch_size} sample(s) per micro-batch, each <= {max_len} tokens"
        micro = math.ceil(data.samples_per_epoch / col.batch_size) if data else 0
    per_step = accum * num_gpus
    steps = steps_per_epoch(micro, num_gpus, accum) * epochs if data else 0  # the loop's own count
    if cfg.training.max_steps:
        steps = min(steps, cfg.training.max_steps) if steps else cfg.training.max_steps
    desc += f" x {accum} accumulation x {num_gpus} GPU(s) = {per_step} micro-batches per step, {epochs} epoch(s)"
    return {"description": desc, "micro_batches_per_epoch": micro, "per_step": per_step}, steps, tokens_per_micro


def plan_run(
    overrides: Sequence[str],
    *,
    num_gpus: int = 8,
    gpu: str = "a100-80g",
    utilization: float = 0.35,
    accelerate_config: Optional[str] = None,
    allow_skipped: bool = False,
    skip_data: bool = False,
) -> RunPlan:
    """Resolve one run and estimate it. Raises :class:`PlanError` listing every problem."""
    from mmtune.training.config import ConfigError, to_sft_config
    from mmtune.training.packed_attention import resolve_attention

    if gpu not in GPU_TYPES:
        raise PlanError(f"unknown GPU type {gpu!r}; known: {', '.join(GPU_TYPES)}")
    try:
        cfg = to_sft_config(compose_run(overrides))
    except (ConfigError, ValueError) as err:
        raise PlanError(f"config [{' '.join(overrides)}] is invalid:\n{err}") from err
    except Exception as err:  # OmegaConf errors name the key; pass them on with the run
        raise PlanError(f"config [{' '.join(overrides)}] does not resolve: {err}") from err

    problems: list[str] = []
    params = None
    try:
        params = count_parameters(cfg.model, cfg.peft, cfg.training)
    except PlanError as err:
        problems.append(str(err))
    original = cfg.context.original_max_position_embeddings or cfg.model.max_position_embeddings
    if original is None:
        model_dict = _model_config_dict(cfg.model)[0]
        if model_dict:
            original = (model_dict.get("text_config") or model_dict).get("max_position_embeddings")
        elif cfg.model.path is None:
            original = ((cfg.model.architecture or {}).get("text_config") or {}).get("max_position_embeddings")
    # The trainer's sample budget: the context window, else the model's own window
    # (it overrides collator.max_length when it connects the data module).
    window = int(cfg.context.max_length or original or cfg.collator.max_length)
    data = None
    if not skip_data:
        try:
            tpi = params.image_tokens if params and params.image_tokens else None
            data = plan_data(cfg.data, tpi, max_length=window, allow_skipped=allow_skipped)
        except PlanError as err:
            problems.append(str(err))
    try:
        stage, off_opt, off_par, origin = _zero_settings(cfg.training, accelerate_config)
    except PlanError as err:
        problems.append(str(err))
        stage, off_opt, off_par, origin = 0, False, False, "?"
    if problems:
        raise PlanError(f"run [{' '.join(overrides)}]:\n" + "\n".join(problems))

    batching, steps, micro_tokens = _batching(cfg, data, num_gpus, window)
    factor = None
    if cfg.context.max_length and original and cfg.context.rope_scaling != "none":
        factor = max(1.0, cfg.context.max_length / original)

    cost = None
    if params is not None and data is not None:
        train_tokens = data.tokens_per_epoch * cfg.training.epochs
        if cfg.training.max_steps and steps:
            full = steps_per_epoch(batching["micro_batches_per_epoch"], num_gpus,
                                   cfg.training.gradient_accumulation_steps) * cfg.training.epochs
            train_tokens = int(train_tokens * min(1.0, steps / max(1, full)))
        cost = estimate_cost(
            params,
            train_tokens=train_tokens,
            train_images=int(data.images_per_epoch * cfg.training.epochs * (train_tokens / max(1, data.tokens_per_epoch * cfg.training.epochs))),
            mean_sample_tokens=min(data.mean_tokens_per_sample, micro_tokens),
            micro_batch_tokens=micro_tokens,
            optimizer_steps=steps,
            weight_dtype=cfg.model.torch_dtype,
            gradient_checkpointing=cfg.training.gradient_checkpointing,
            zero_stage=stage,
            offload_optimizer=off_opt,
            offload_params=off_par,
            num_gpus=num_gpus,
            gpu=GPU_TYPES[gpu],
            utilization=utilization,
            vision_trains=cfg.training.vision.train,
            loss_impl=cfg.training.loss_impl,
            loss_chunk_size=cfg.training.loss_chunk_size,
            head_trains=cfg.training.language_model.train and cfg.peft.method == "none",
        )
    ev = cfg.eval
    return RunPlan(
        overrides=list(overrides),
        run_name=cfg.run_name,
        output_dir=cfg.training.output_dir,
        model={k: getattr(cfg.model, k) for k in ("family", "path", "torch_dtype", "attn_implementation")},
        params=asdict(params) if params else None,
        data=asdict(data) if data else None,
        context={"max_length": cfg.context.max_length, "rope_scaling": cfg.context.rope_scaling,
                 "original": original, "factor": factor},
        peft={"method": cfg.peft.method, "r": cfg.peft.r, "alpha": cfg.peft.alpha, "dropout": cfg.peft.dropout,
              "train_vision": cfg.training.vision.train, "train_projector": cfg.training.projector.train,
              "train_language_model": cfg.training.language_model.train},
        batching=batching,
        attention=resolve_attention(cfg.training.packed_attention, batching=cfg.collator.batching,
                                    attn_implementation=cfg.model.attn_implementation).description,
        zero={"stage": stage, "offload_optimizer": off_opt, "offload_params": off_par, "origin": origin,
              "num_gpus": num_gpus},
        cost=asdict(cost) if cost else None,
        evaluation={"benchmarks": list(ev.benchmarks) if (cfg.training.eval_before or cfg.training.eval_after) else [],
                    "context_length": ev.generation.context_length, "before": cfg.training.eval_before,
                    "after": cfg.training.eval_after},
    )


# ----------------------------------------------------------------------------- evaluation runs


@dataclass
class BenchmarkPlan:
    name: str
    data_path: Optional[str]
    items: int
    """Dialogues (MMDU, synthetic) or questions (MM-Vet, MDI); 0 for lmms-eval."""
    answers: int
    """Answers the model generates."""
    judge_calls: int
    """Judge calls (before the cache: a re-run pays nothing again)."""
    images: int
    note: str = ""


@dataclass
class EvalPlan:
    overrides: list[str]
    run_name: str
    output_dir: str
    model: dict[str, Any]
    params: Optional[dict[str, Any]]
    context_length: Optional[int]
    benchmarks: list[dict[str, Any]]
    judge_model: Optional[str]
    memory_gib: dict[str, float]
    decode_gpu_hours_max: float
    gpu: str
    fits: bool
    generation: list[dict[str, Any]] = field(default_factory=list)
    """Per benchmark: :class:`mmtune.evaluation.throughput.GenerationEstimate` as a dict."""

    def render(self) -> str:
        m = self.model
        lines = [f"== evaluation {self.run_name}  [{' '.join(self.overrides)}]", f"  output      {self.output_dir}",
                 f"  model       {m['family']}  path={m['path']}  dtype={m['torch_dtype']}"]
        if self.params:
            lines.append(f"  parameters  total {_h(self.params['total'])}  [{self.params['source']}]")
        lines.append(f"  window      {self.context_length or 'the model default'}")
        for b in self.benchmarks:
            what = (f"{b['items']:,} items, {b['answers']:,} answers, {b['images']:,} images, "
                    f"{b['judge_calls']:,} judge calls" if b["items"] else b["note"])
            lines.append(f"  benchmark   {b['name']:<10} {what}" + (f"  {b['data_path']}" if b["data_path"] else ""))
        lines.append(f"  judge       {self.judge_model or 'from $MMTUNE_JUDGE_MODEL'}")
        mem = self.memory_gib
        lines.append("  memory/GPU  " + ", ".join(f"{k} {v:.1f}" for k, v in mem.items() if k != "total")
                     + f" => {mem['total']:.1f} GiB on {self.gpu} " + ("(fits)" if self.fits else "(DOES NOT FIT)"))
        lines.append(f"  generation  <= {self.decode_gpu_hours_max:.1f} GPU-hours if every answer used max_new_tokens "
                     "(greedy decoding is bandwidth-bound: weight bytes / HBM bandwidth per token)")
        lines += render_generation_estimates(self.generation)
        return "\n".join(lines)


def _count_benchmark(name: str, sub: Any, cache_dir: Optional[str], problems: list[str]) -> BenchmarkPlan:
    """Read a benchmark's data through the data layer (MMDU schema) or as JSON, checking images."""
    if getattr(sub, "predictions", None):
        if not os.path.isfile(sub.predictions):
            problems.append(f"eval.{name}.predictions={sub.predictions!r} does not exist")
        return BenchmarkPlan(name, sub.predictions, 0, 0, 0, 0, note="scores an existing predictions file")
    path = sub.data_path
    if not path or not os.path.isfile(path):
        problems.append(f"eval.{name}.data_path={path!r} does not exist (download the benchmark or set the path)")
        return BenchmarkPlan(name, path, 0, 0, 0, 0)
    if name in ("mmdu", "synthetic"):
        from mmtune.data.config import SourceConfig
        from mmtune.data.readers import load_source

        sd = load_source(SourceConfig(name=f"eval_{name}", format="mmdu", path=path, image_root=sub.image_root),
                         mode="skip", cache_dir=cache_dir, check_images="exists")
        if sd.report.records_skipped:
            problems.append(f"eval.{name}: {sd.report.records_skipped} dialogue(s) cannot be evaluated\n"
                            + sd.report.render())
        answers = sum(sum(1 for _ in d.exchanges()) for d in sd.dialogues)
        return BenchmarkPlan(name, path, len(sd), answers, answers if name == "mmdu" else 0, sd.report.images)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    items = list(data.values()) if isinstance(data, dict) else list(data)
    key = "imagename" if name == "mmvet" else "image_path"
    missing = 0
    if sub.image_root:
        for item in items:
            image = str(item.get(key, ""))
            image = image if name == "mmvet" or image.endswith(".png") else image + ".png"
            missing += not os.path.isfile(os.path.join(sub.image_root, image))
    if missing:
        problems.append(f"eval.{name}: {missing} of {len(items)} images are missing under {sub.image_root}")
    runs = getattr(sub, "runs", 1) if name == "mmvet" else 0
    return BenchmarkPlan(name, path, len(items), len(items), len(items) * runs, len(items))


def plan_generation(gen_cfg: Any, model_cfg: Any, params: ParamCounts, benches: Sequence[BenchmarkPlan],
                    gpu: GpuType) -> list[dict[str, Any]]:
    """Generation time of each benchmark on the batched KV path (or re-encoding), at the
    batch size the config resolves to for this model; see :mod:`mmtune.evaluation.throughput`."""
    from mmtune.evaluation.throughput import estimate_generation, resolve_batch_size

    text = _model_config_dict(model_cfg)[0] or {}
    text = text.get("text_config") or text
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    wbytes = _DTYPE_BYTES.get(model_cfg.torch_dtype, 4)
    kv_per_token = 2 * params.num_layers * kv_heads * (params.hidden_size // heads) * wbytes
    window = gen_cfg.context_length or int(text.get("max_position_embeddings") or 4096)
    batch = resolve_batch_size(gen_cfg, params.total)
    out = []
    for b in benches:
        if not b.answers:
            continue
        est = estimate_generation(
            b.name, dialogues=b.items, answers=b.answers, images=b.images, tokens_per_image=params.image_tokens or 0,
            answer_tokens=gen_cfg.max_new_tokens, batch_size=batch, params=params.total,
            weight_bytes=wbytes * params.total, kv_bytes_per_token=kv_per_token, window=window,
            hbm_tbps=gpu.hbm_tbps, peak_tflops=gpu.peak_tflops, kv_reuse=gen_cfg.kv_reuse,
        )
        out.append(asdict(est))
    return out


def render_generation_estimates(estimates: Sequence[dict[str, Any]]) -> list[str]:
    """Plan lines of :func:`plan_generation`'s estimates."""
    from mmtune.evaluation.throughput import DECODE_EFFICIENCY

    lines = []
    for e in estimates:
        lines.append(f"  gen time    {e['benchmark']:<10} <= {e['hours']:.2f} GPU-h at B={e['batch_size']} "
                     f"(B=1: {e['hours_batch1']:.2f}); {e['answers']:,} answers x {e['answer_tokens']} tokens in "
                     f"{e['rounds']:,} rounds, {_h(e['prefill_tokens'])} prefill tokens, "
                     f"decode {e['decode_tokens_per_s']:,.0f} tok/s")
    if lines:
        lines.append(f"              (decode at {DECODE_EFFICIENCY:.0%} of HBM bandwidth, weights + KV read per step; "
                     "every answer at max_new_tokens)")
    return lines


def plan_evaluation(overrides: Sequence[str], *, gpu: str = "a100-80g") -> EvalPlan:
    """Resolve one ``recipes/evaluate.py`` run: model, benchmark data, judge calls, memory."""
    from mmtune.evaluation.config import to_evaluate_config

    if gpu not in GPU_TYPES:
        raise PlanError(f"unknown GPU type {gpu!r}; known: {', '.join(GPU_TYPES)}")
    try:
        cfg = to_evaluate_config(compose_run(overrides, config_name="evaluate"))
    except Exception as err:  # noqa: BLE001 - config errors name the key; report them with the run
        raise PlanError(f"evaluation config [{' '.join(overrides)}] is invalid:\n{err}") from err
    problems: list[str] = []
    model_cfg = copy.copy(cfg.model)
    if cfg.checkpoint:
        run_file = Path(cfg.checkpoint) / "mmtune_run.json"
        if not Path(cfg.checkpoint).is_dir():
            problems.append(f"checkpoint={cfg.checkpoint!r} does not exist (train it first, or fix the path)")
        elif run_file.is_file():
            model_cfg.family = json.loads(run_file.read_text()).get("family", model_cfg.family)
        model_cfg.path = cfg.checkpoint
    params = None
    try:
        peft = argparse.Namespace(method="none", r=0, target_modules=None)
        frozen = argparse.Namespace(**{g: argparse.Namespace(train=False) for g in ("vision", "projector", "language_model")})
        params = count_parameters(model_cfg, peft, frozen)
    except PlanError as err:
        problems.append(str(err))
    from mmtune.data.config import default_cache_dir

    cache_dir = os.path.join(default_cache_dir(), "eval")
    benches = []
    for name in cfg.eval.benchmarks:
        if name == "lmms_eval":
            benches.append(BenchmarkPlan("lmms_eval", None, 0, 0, 0, 0,
                                         note="lmms-eval tasks " + ", ".join(cfg.eval.lmms_eval.tasks)))
        else:
            benches.append(_count_benchmark(name, getattr(cfg.eval, name), cache_dir, problems))
    if problems:
        raise PlanError(f"evaluation [{' '.join(overrides)}]:\n" + "\n".join(problems))
    g = GPU_TYPES[gpu]
    wbytes = _DTYPE_BYTES.get(model_cfg.torch_dtype, 4)
    window = cfg.eval.generation.context_length
    mem = {"weights": 0.0, "kv_cache": 0.0, "overhead": _OVERHEAD_GIB}
    hours = 0.0
    if params:
        text = _model_config_dict(model_cfg)[0] or {}
        text = text.get("text_config") or text
        heads = int(text.get("num_attention_heads") or 1)
        kv = int(text.get("num_key_value_heads") or heads)
        window_tokens = window or int(text.get("max_position_embeddings") or 4096)
        mem["weights"] = wbytes * params.total / 1024**3
        mem["kv_cache"] = 2 * params.num_layers * kv * (params.hidden_size // heads) * window_tokens * wbytes / 1024**3
        answers = sum(b.answers for b in benches)
        hours = answers * cfg.eval.generation.max_new_tokens * (wbytes * params.total) / (g.hbm_tbps * 1e12) / 3600
    mem["total"] = sum(mem.values())
    return EvalPlan(
        overrides=list(overrides), run_name=cfg.run_name, output_dir=cfg.output_dir,
        model={k: getattr(model_cfg, k) for k in ("family", "path", "torch_dtype", "attn_implementation")},
        params=asdict(params) if params else None, context_length=window,
        benchmarks=[asdict(b) for b in benches], judge_model=cfg.eval.judge.model, memory_gib=mem,
        decode_gpu_hours_max=hours, gpu=g.name, fits=mem["total"] <= g.memory_gib,
        generation=plan_generation(cfg.eval.generation, model_cfg, params, benches, g) if params else [],
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mmtune plan",
        description="Resolve a run or a sweep without loading weights; print model, data, steps, tokens, "
        "GPU-hours and memory per GPU. Positional arguments are Hydra overrides (experiment=...).",
        epilog=__doc__.split("Cost model", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. experiment=table5_mmdu45k_8k")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=None,
                        help="which recipe the run is for: sft (default) or evaluate (evaluation-only rows); "
                        "a sweep's `program` decides for --sweep")
    parser.add_argument("--sweep", help="a W&B sweep YAML (launch/sweeps/*.yaml): plan every grid point")
    parser.add_argument("--list", action="store_true", help="with --sweep: print each grid point's overrides and exit")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs in total (default 8)")
    parser.add_argument("--gpu", default="a100-80g", choices=sorted(GPU_TYPES), help="GPU type (default a100-80g)")
    parser.add_argument("--utilization", type=float, default=0.35,
                        help="assumed fraction of peak bf16 FLOP/s achieved, recompute included (default 0.35)")
    parser.add_argument("--accelerate-config", help="accelerate config whose DeepSpeed settings the run uses")
    parser.add_argument("--allow-skipped", action="store_true",
                        help="plan even if records would be skipped for missing or broken images")
    parser.add_argument("--json", help="also write the plans as JSON to this file")
    args = parser.parse_args(list(argv) if argv is not None else None)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    accelerate_config = args.accelerate_config
    recipe = args.recipe or "sft"
    if args.sweep:
        try:
            points = [p + list(args.overrides) for p in sweep_grid(args.sweep)]
            accelerate_config = accelerate_config or sweep_accelerate_config(args.sweep)
            recipe = args.recipe or sweep_recipe(args.sweep)
        except (ValueError, OSError) as err:
            print(f"mmtune plan: {args.sweep}: {err}", file=sys.stderr)
            return 2
    elif args.overrides:
        points = [list(args.overrides)]
        recipe = args.recipe or experiment_recipe(args.overrides)
    else:
        parser.print_usage(sys.stderr)
        print("mmtune plan: give Hydra overrides (experiment=...) or --sweep FILE", file=sys.stderr)
        return 2
    if args.list:
        for p in points:
            print(" ".join(p))
        return 0

    plans, failures = [], []
    for point in points:
        try:
            if recipe == "evaluate":
                plan = plan_evaluation(point, gpu=args.gpu)
            else:
                plan = plan_run(point, num_gpus=args.gpus, gpu=args.gpu, utilization=args.utilization,
                                accelerate_config=accelerate_config, allow_skipped=args.allow_skipped)
        except PlanError as err:
            failures.append(str(err))
            print(f"== run [{' '.join(point)}]: CANNOT START\n{err}\n", file=sys.stderr)
            continue
        plans.append(plan)
        print(plan.render() + "\n")
    if len(points) > 1:
        total = sum(p.cost["gpu_hours"] for p in plans if isinstance(p, RunPlan) and p.cost)
        print(f"== {len(plans)} runs planned, {len(failures)} cannot start"
              + (f"; ~{total:.1f} GPU-hours of training in total" if recipe == "sft" else ""))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in plans], indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""The training cost model of ``mmtune plan``: FLOPs, GPU-hours and memory per GPU.

Cost model (stated in the output as well):

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

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mmtune.training.plan.common import PlanError
from mmtune.training.plan.gpus import DTYPE_BYTES, OVERHEAD_GIB, GpuType
from mmtune.training.engines.base import StateMemory
from mmtune.training.plan.model import ParamCounts

__all__ = ["CostEstimate", "estimate_cost", "zero_settings", "resolve_launch_file", "launcher_processes", "launch_config",
           "ZERO3_LIVE_PARAMETERS"]

ZERO3_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's ``stage3_max_live_parameters`` default: parameters gathered at once under ZeRO-3."""


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
    sequence_parallel: int = 1
    longest_row_tokens: int = 0
    """The longest row (tokens) whose memory per GPU still fits, at this sequence-parallel size."""


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
    state: Optional[StateMemory] = None,
    engine: str = "",
    sequence_parallel: int = 1,
) -> CostEstimate:
    """Compute and memory estimate (formulas in the module docstring).

    ``loss_impl`` (``training.loss_impl``; ``auto`` counts as ``fused`` when Liger is
    installed, else ``chunked``) decides the logits term, the loss's peak working memory
    at the start of the backward pass for a micro-batch of ``s`` tokens:

    * ``materialized``: ``14·s·V`` B (16-bit logits, their fp32 copy, the fp32
      log-softmax kept for backward, and its fp32 gradient in backward);
    * ``chunked``: ``6·c·V`` B for one chunk of ``c = min(s, loss_chunk_size)`` rows
      (an fp32 block of logits, turned into their gradient in place, and its 16-bit copy
      for the matmuls, both allocated once), the gradients computed in the forward pass
      and held until backward: the hidden states' ``2·s·d`` and, when the head trains, the
      chunk's 16-bit weight-gradient product ``2·V·d`` and (16-bit weights) the fp32
      weight-gradient accumulator ``4·V·d``;
    * ``fused`` (Liger): ``2·c·V`` B with Liger's chunk ``c = 2^ceil(log2(s / ceil(V/d)))``
      plus the gradients it computes in the forward pass and holds until backward,
      ``2·s·d + 4·V·d`` B.

    With ``sequence_parallel = N`` a GPU holds ``s / N`` tokens of each row through the
    decoder and the loss (activations and the loss term at ``s / N``), plus the whole row's
    merged embeddings ``2·s·d`` B (before the shard is taken). ``longest_row_tokens`` solves
    the memory total for the row length that still fits the GPU.
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

    wbytes = DTYPE_BYTES.get(weight_dtype, 4)
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
    if state is not None:  # the engine's own accounting (training.backend)
        weights, grads, optim, gathered = state.weights, state.gradients, state.optimizer, state.gathered
    if loss_impl == "auto":
        from mmtune.training.loss import choose_loss_impl

        loss_impl = choose_loss_impl(loss_impl, device_type="cuda").impl  # planned on GPUs; Liger as installed
    head_grad_fp32 = 4 * V * d if head_trains and wbytes < 4 else 0
    n = max(1, sequence_parallel)
    gib = 1024**3

    def memory(s: int) -> dict[str, float]:
        r = math.ceil(s / n)  # this GPU's tokens of the row
        act = (2 * r * d * L + 34 * r * d) if gradient_checkpointing else 34 * r * d * L
        if n > 1:
            act += 2 * s * d  # the whole row's merged embeddings, before the shard is taken
        if loss_impl == "chunked":
            c = min(r, max(1, loss_chunk_size))
            logits = 6 * c * V + 2 * r * d + ((2 * V * d + head_grad_fp32) if head_trains else 0)
        elif loss_impl == "fused":
            c = min(r, 2 ** math.ceil(math.log2(max(1.0, r / math.ceil(V / d)))))
            logits = 2 * c * V + 2 * r * d + (4 * V * d if head_trains else 0)
        else:
            logits = 14 * r * V
        out = {"weights": weights / gib, "zero3_gathered": gathered / gib, "gradients": grads / gib,
               "optimizer": optim / gib, "activations": act / gib, "logits": logits / gib, "overhead": OVERHEAD_GIB}
        out["total"] = sum(out.values())
        return out

    s = micro_batch_tokens
    mem = memory(s)
    # Past one loss chunk per GPU the total grows linearly with the row: solve it for the GPU's memory.
    first = n * max(1, loss_chunk_size) * 2
    low, high = memory(first)["total"], memory(2 * first)["total"]
    longest = int(first + (gpu.memory_gib - low) * first / max(high - low, 1e-12)) if high > low else 0
    longest = max(0, longest // n * n)
    formula = (
        "FLOPs = tokens·(4·N_lm + 2·N_trainable_lm [+2·N_lm ckpt] + 6·L·d·s̄ [×4/3 ckpt]) + "
        "(2|6)·N_vision·patches; GPU-h = FLOPs / (peak·utilization) / 3600. "
        "Memory = weights + grads + AdamW (8 or 12 B/param) "
        + (f"as {engine} holds them" if engine else "sharded by ZeRO stage (+1e9 gathered params under ZeRO-3)")
        + " + activations "
        "(34·s·d·L B, or 2·s·d·L + 34·s·d with ckpt; s = a row's tokens / sequence-parallel size, "
        "+ 2·row·d B for the whole row's embeddings when it is > 1) + logits/loss term (training.loss_impl=" + loss_impl + ": "
        + {"chunked": "6·c·V + 2·s·d [+2·V·d +4·V·d fp32 head grad] B, c = loss_chunk_size rows",
           "fused": "2·c·V + 2·s·d + 4·V·d B, c = Liger's chunk"}.get(loss_impl, "14·s·V B") + ") + 1.5 GiB."
    )
    return CostEstimate(
        gpu=gpu.name, num_gpus=G, utilization=utilization, zero_stage=zero_stage,
        offload_optimizer=offload_optimizer, offload_params=offload_params, optimizer_steps=optimizer_steps,
        train_tokens=train_tokens, micro_batch_tokens=s, flops=flops, gpu_hours=gpu_hours,
        wall_hours=gpu_hours / G, memory_gib=mem, fits=mem["total"] <= gpu.memory_gib, formula=formula,
        sequence_parallel=n, longest_row_tokens=longest,
    )


def resolve_launch_file(path: str, what: str = "accelerate config") -> str:
    """A launch file as given when it exists from the current folder, else the same
    relative path under the project (where ``launch/`` lives), as the README's commands
    name them from the repository root.

    Raises:
        PlanError: neither exists (both places named).
    """
    from mmtune.data.config import configs_dir

    if os.path.isfile(path):
        return path
    project = Path(configs_dir()).resolve().parent / path
    if not os.path.isabs(path) and project.is_file():
        return str(project)
    tried = f"{os.path.abspath(path)}" + ("" if os.path.isabs(path) else f" or {project}")
    raise PlanError(f"{what} {path!r} not found (tried {tried})")


def launcher_processes(accelerate_config: str) -> Optional[int]:
    """GPUs an accelerate config launches (``num_processes``; per machine x ``num_machines``
    when it gives a per-node count), or None when it does not say."""
    from omegaconf import OmegaConf

    acc = OmegaConf.to_container(OmegaConf.load(resolve_launch_file(accelerate_config))) or {}
    processes = acc.get("num_processes")
    return int(processes) if isinstance(processes, int) and processes > 0 else None


def launch_config(accelerate_config: str) -> dict[str, Any]:
    """An accelerate config file as a dict, what an engine's ``launch_config_problem`` reads:
    a DeepSpeed section that names a DeepSpeed JSON gets that file's ZeRO stage as its
    ``zero_stage``, as if written inline.

    Raises:
        PlanError: the file (or the DeepSpeed JSON it names) is not found.
    """
    from omegaconf import OmegaConf

    acc = OmegaConf.to_container(OmegaConf.load(resolve_launch_file(accelerate_config))) or {}
    ds = acc.get("deepspeed_config") or {}
    if ds.get("deepspeed_config_file"):
        ds_path = resolve_launch_file(ds["deepspeed_config_file"], "DeepSpeed config")
        stage = json.loads(Path(ds_path).read_text()).get("zero_optimization", {}).get("stage", 0)
        acc["deepspeed_config"] = {**ds, "zero_stage": int(stage)}
    return acc


def zero_settings(training_cfg: Any, accelerate_config: Optional[str]) -> tuple[int, bool, bool, str]:
    """ZeRO stage and offload from the DeepSpeed JSON (training config or accelerate config);
    relative paths resolve from the current folder, then from the project (:func:`resolve_launch_file`).
    Stage 0 and no offload under any other engine (the origin names it and the launch file)."""
    backend = training_cfg.backend
    if backend.engine != "deepspeed":
        return 0, False, False, (f"training.backend.engine={backend.engine}"
                                 + (f" ({accelerate_config})" if accelerate_config else ""))
    ds_path = backend.deepspeed.config_file
    origin = "training.backend.deepspeed.config_file"
    if accelerate_config:
        from omegaconf import OmegaConf

        acc = OmegaConf.to_container(OmegaConf.load(resolve_launch_file(accelerate_config)))
        ds = (acc or {}).get("deepspeed_config") or {}
        if ds.get("deepspeed_config_file"):
            ds_path = resolve_launch_file(ds["deepspeed_config_file"], "DeepSpeed config")
            origin = f"{accelerate_config} -> {ds['deepspeed_config_file']}"
        elif ds:
            return (int(ds.get("zero_stage", 0)), ds.get("offload_optimizer_device", "none") not in (None, "none"),
                    ds.get("offload_param_device", "none") not in (None, "none"), accelerate_config)
        # else a plain launch: the engine builds its plugin from training.backend.deepspeed
    if not ds_path:
        d = backend.deepspeed
        return d.stage, d.offload_optimizer, d.offload_params, "training.backend.deepspeed"
    try:
        ds_path = resolve_launch_file(ds_path, "DeepSpeed config")
    except PlanError as err:
        raise PlanError(f"{err} ({origin})") from None
    zero = json.loads(Path(ds_path).read_text()).get("zero_optimization", {})

    def off(key: str) -> bool:
        return str((zero.get(key) or {}).get("device", "none")) not in ("none", "None")

    return int(zero.get("stage", 0)), off("offload_optimizer"), off("offload_param"), origin

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
  master copy when weights are 16-bit) as the run's engine holds them on one GPU, with the
  full weights it gathers while computing: each engine's ``state_memory``
  (``training.backend``: DDP replicates, DeepSpeed's ZeRO stages and FSDP2 shard; see
  :mod:`mmtune.training.engines`). Activations (16-bit,
  FlashAttention/SDPA so no ``s²`` score matrix): ``34·s·d``
  bytes per layer for ``s`` tokens in a micro-batch (Korthikanti et al., 2022); with
  gradient checkpointing ``2·s·d`` per layer plus one layer's ``34·s·d``. Logits:
  the loss's working memory per ``training.loss_impl`` (materialised ``14·s·V`` bytes; the
  chunked and fused linear cross-entropy hold one chunk of logits: see
  :func:`estimate_cost`). Plus 1.5 GiB for the CUDA context
  and allocator slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmtune.training.plan.gpus import DTYPE_BYTES, OVERHEAD_GIB, GpuType
from mmtune.training.engines.base import StateMemory
from mmtune.training.plan.model import ParamCounts

__all__ = ["CostEstimate", "estimate_cost"]


@dataclass
class CostEstimate:
    gpu: str
    num_gpus: int
    utilization: float
    engine: str
    """The engine whose state memory the estimate adds up, as it describes itself."""
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
    state: StateMemory,
    engine: str,
    num_gpus: int,
    gpu: GpuType,
    utilization: float,
    vision_trains: bool = False,
    loss_impl: str = "materialized",
    loss_chunk_size: int = 1024,
    head_trains: bool = True,
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
    flops = _training_flops(params, train_tokens=train_tokens, train_images=train_images,
                            mean_sample_tokens=mean_sample_tokens, gradient_checkpointing=gradient_checkpointing,
                            vision_trains=vision_trains)
    gpu_hours = flops / (gpu.peak_tflops * 1e12 * utilization) / 3600
    wbytes = DTYPE_BYTES.get(weight_dtype, 4)
    G = max(1, num_gpus)
    d, L, V = params.hidden_size, params.num_layers, params.vocab_size
    if loss_impl == "auto":
        from mmtune.training.loss import choose_loss_impl

        loss_impl = choose_loss_impl(loss_impl, device_type="cuda").impl  # planned on GPUs; Liger as installed
    head_grad_fp32 = 4 * V * d if head_trains and wbytes < 4 else 0
    n = max(1, sequence_parallel)

    def memory(s: int) -> dict[str, float]:
        return _memory_gib(s, state=state, d=d, L=L, V=V, sequence_parallel=n,
                           gradient_checkpointing=gradient_checkpointing, loss_impl=loss_impl,
                           loss_chunk_size=loss_chunk_size, head_trains=head_trains, head_grad_fp32=head_grad_fp32)

    s = micro_batch_tokens
    mem = memory(s)
    # Past one loss chunk per GPU the total grows linearly with the row: solve it for the GPU's memory.
    first = n * max(1, loss_chunk_size) * 2
    low, high = memory(first)["total"], memory(2 * first)["total"]
    longest = int(first + (gpu.memory_gib - low) * first / max(high - low, 1e-12)) if high > low else 0
    longest = max(0, longest // n * n)
    formula = _formula(engine, loss_impl)
    return CostEstimate(
        gpu=gpu.name, num_gpus=G, utilization=utilization, engine=engine, optimizer_steps=optimizer_steps,
        train_tokens=train_tokens, micro_batch_tokens=s, flops=flops, gpu_hours=gpu_hours,
        wall_hours=gpu_hours / G, memory_gib=mem, fits=mem["total"] <= gpu.memory_gib, formula=formula,
        sequence_parallel=n, longest_row_tokens=longest,
    )


def _memory_gib(s: int, *, state: StateMemory, d: int, L: int, V: int, sequence_parallel: int,
                gradient_checkpointing: bool, loss_impl: str, loss_chunk_size: int, head_trains: bool,
                head_grad_fp32: float) -> dict[str, float]:
    """GiB per GPU for rows of ``s`` tokens: the engine's state, activations, the loss term, overhead."""
    gib, n = 1024**3, sequence_parallel
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
    out = {"weights": state.weights / gib, "gathered": state.gathered / gib, "gradients": state.gradients / gib,
           "optimizer": state.optimizer / gib, "activations": act / gib, "logits": logits / gib,
           "overhead": OVERHEAD_GIB}
    out["total"] = sum(out.values())
    return out


def _formula(engine: str, loss_impl: str) -> str:
    """The cost model in one paragraph, as the plan's JSON records it."""
    return (
        "FLOPs = tokens·(4·N_lm + 2·N_trainable_lm [+2·N_lm ckpt] + 6·L·d·s̄ [×4/3 ckpt]) + "
        "(2|6)·N_vision·patches; GPU-h = FLOPs / (peak·utilization) / 3600. "
        f"Memory = weights + grads + AdamW (8 or 12 B/param) as {engine} holds them + activations "
        "(34·s·d·L B, or 2·s·d·L + 34·s·d with ckpt; s = a row's tokens / sequence-parallel size, "
        "+ 2·row·d B for the whole row's embeddings when it is > 1) + logits/loss term (training.loss_impl=" + loss_impl + ": "
        + {"chunked": "6·c·V + 2·s·d [+2·V·d +4·V·d fp32 head grad] B, c = loss_chunk_size rows",
           "fused": "2·c·V + 2·s·d + 4·V·d B, c = Liger's chunk"}.get(loss_impl, "14·s·V B") + ") + 1.5 GiB."
    )


def _training_flops(params: ParamCounts, *, train_tokens: int, train_images: int, mean_sample_tokens: float,
                    gradient_checkpointing: bool, vision_trains: bool) -> float:
    """FLOPs of training on ``train_tokens`` tokens and ``train_images`` images (the module docstring's compute)."""
    n_lm, n_train_lm = params.language_model, params.trainable_language_model
    d, L = params.hidden_size, params.num_layers
    per_token = 2 * n_lm + 2 * n_lm + 2 * n_train_lm
    attn = 6 * L * d * mean_sample_tokens
    if gradient_checkpointing:
        per_token += 2 * n_lm
        attn *= 4 / 3
    patches = (params.image_tokens or 0) * train_images
    vision = (6 if vision_trains else 2) * params.vision * patches
    return train_tokens * (per_token + attn) + vision

"""How long answering a benchmark takes, and how many dialogues to decode together.

A roofline model of the generator's batched KV path. One decode step of ``B`` rows
reads every weight once and each row's KV cache once; at the batch sizes used here that
memory traffic, not arithmetic, sets the step time:

    step_s(B) = (weight_bytes + B * kv_bytes_per_token * mean_context) / (bandwidth * DECODE_EFFICIENCY)

so ``B`` rows decode almost ``B`` times faster than one, until the KV term dominates.
Prefill (each turn's new tokens: question and images) is compute-bound:
``2 * params * tokens / (peak_flops * PREFILL_MFU)``. The batched path answers ``B``
turns per round and the round lasts as long as its longest answer, so every answer is
taken at ``answer_tokens`` (``max_new_tokens`` by default: an upper bound, which is
also what a random or babbling model costs). Both efficiency factors are stated
assumptions, not measurements; ``bench/gpu_generation.py`` measures decode tokens/s
to check them against.

On ``gpus`` GPUs (a data-parallel evaluation, :mod:`mmtune.evaluation.generation.data_parallel`)
each rank answers a share of whole dialogues balanced by tokens, so the wall time is that
of the largest share: ``ceil(dialogues / gpus)`` dialogues with their answers and images
(:func:`estimate_data_parallel`). Ranks beyond the number of dialogues have nothing to do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DECODE_EFFICIENCY",
    "PREFILL_MFU",
    "QUESTION_TOKENS",
    "GenerationEstimate",
    "resolve_batch_size",
    "estimate_generation",
    "estimate_data_parallel",
]

DECODE_EFFICIENCY = 0.6
"""Fraction of HBM bandwidth a decode step reaches (weights + KV streamed once per step)."""
PREFILL_MFU = 0.4
"""Fraction of the dense bf16 peak a prefill forward reaches."""
QUESTION_TOKENS = 48
"""Text tokens of one user turn (question + template) when the benchmark's text is not tokenized."""


def _params_from_label(label: str) -> float:
    """``"8B"`` -> 8e9, ``"500M"`` -> 5e8; ``"inf"`` for everything larger."""
    text = label.strip().upper()
    if text in ("INF", "ANY"):
        return math.inf
    scale = {"B": 1e9, "M": 1e6}.get(text[-1:])
    if scale is None:
        raise ValueError(f"eval.generation.batch_size_by_size key {label!r}: write a size such as '8B', '500M' or 'inf'")
    return float(text[:-1]) * scale


def resolve_batch_size(cfg: Any, num_params: int) -> int:
    """``cfg.batch_size`` when set, else the entry of ``cfg.batch_size_by_size`` for the smallest size >= ``num_params``.

    Raises:
        ValueError: a size key that does not parse, or no entry covers the model.
    """
    if cfg.batch_size is not None:
        return int(cfg.batch_size)
    table = sorted((_params_from_label(k), int(v)) for k, v in cfg.batch_size_by_size.items())
    for limit, batch in table:
        if num_params <= limit:
            return batch
    raise ValueError(
        f"eval.generation.batch_size_by_size {dict(cfg.batch_size_by_size)} has no entry for a model of "
        f"{num_params / 1e9:.1f}B parameters; add a larger size (or 'inf') or set eval.generation.batch_size"
    )


@dataclass
class GenerationEstimate:
    """Generation cost of one benchmark at one batch size (times in hours, one GPU)."""

    benchmark: str
    answers: int
    batch_size: int
    answer_tokens: int
    prefill_tokens: int
    """Tokens run through prefill (KV path: each prompt token once; re-encode: the history every turn)."""
    decode_tokens: int
    rounds: int
    """Batched rounds: ``B`` answers each, lasting ``answer_tokens`` steps."""
    forward_calls: int
    decode_tokens_per_s: float
    """All rows together, at ``batch_size``."""
    hours: float
    hours_batch1: float
    """The same work one dialogue at a time (the speed-up is hours_batch1 / hours)."""


def estimate_generation(
    benchmark: str,
    *,
    dialogues: int,
    answers: int,
    images: int,
    tokens_per_image: int,
    answer_tokens: int,
    batch_size: int,
    params: int,
    weight_bytes: float,
    kv_bytes_per_token: float,
    window: int,
    hbm_tbps: float,
    peak_tflops: float,
    kv_reuse: bool = True,
    question_tokens: int = QUESTION_TOKENS,
) -> GenerationEstimate:
    """Estimate the generation time of one benchmark (see the module docstring for the model).

    Args:
        dialogues: dialogues (multi-turn) or items (single-turn benchmarks: one answer each).
        answers: answers to generate (turns over all dialogues).
        images, tokens_per_image: the benchmark's images and what each costs in tokens.
        answer_tokens: tokens per answer (``max_new_tokens`` for an upper bound).
        params, weight_bytes: the model's parameter count and their bytes.
        kv_bytes_per_token: K and V of one token over all layers, in bytes.
        window: context window; histories longer than it are cut to it.
        hbm_tbps, peak_tflops: the GPU's memory bandwidth (TB/s) and dense bf16 peak.
        kv_reuse: the KV path (prefill only new tokens) or re-encoding (the history every turn).
    """
    dialogues, answers = max(dialogues, 1), max(answers, 0)
    turns = answers / dialogues
    per_turn = (images * tokens_per_image + answers * question_tokens) / max(answers, 1)
    per_exchange = per_turn + answer_tokens
    # mean history a decode step attends to: half a dialogue, capped at the window
    mean_context = min(window, (turns + 1) / 2 * per_exchange)
    if kv_reuse:
        prefill = answers * per_turn
    else:  # turn t re-encodes t exchanges (each at most a window)
        prefill = dialogues * sum(min(window, t * per_exchange) for t in range(1, math.ceil(turns) + 1))

    def hours(batch: int) -> tuple[float, int, int, float]:
        rounds = math.ceil(answers / batch)
        step_s = (weight_bytes + batch * kv_bytes_per_token * mean_context) / (hbm_tbps * 1e12 * DECODE_EFFICIENCY)
        prefill_s = 2 * params * prefill / (peak_tflops * 1e12 * PREFILL_MFU)
        total_s = rounds * answer_tokens * step_s + prefill_s
        return total_s / 3600, rounds, rounds * answer_tokens, batch / step_s

    h, rounds, calls, rate = hours(batch_size)
    return GenerationEstimate(
        benchmark=benchmark, answers=answers, batch_size=batch_size, answer_tokens=answer_tokens,
        prefill_tokens=int(prefill), decode_tokens=answers * answer_tokens, rounds=rounds, forward_calls=calls,
        decode_tokens_per_s=rate, hours=h, hours_batch1=hours(1)[0],
    )


def estimate_data_parallel(benchmark: str, *, gpus: int, dialogues: int, answers: int, images: int,
                           **kwargs: Any) -> tuple[int, GenerationEstimate]:
    """(GPUs that get work, the estimate of one rank's share) when ``gpus`` processes split
    the dialogues: the share's ``hours`` are the evaluation's wall time on those GPUs.
    ``kwargs`` are :func:`estimate_generation`'s other arguments."""
    used = max(1, min(gpus, dialogues))
    per_rank = math.ceil(max(dialogues, 1) / used)
    share = per_rank / max(dialogues, 1)
    return used, estimate_generation(benchmark, dialogues=per_rank, answers=math.ceil(answers * share),
                                     images=math.ceil(images * share), **kwargs)

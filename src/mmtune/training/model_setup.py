"""The model a run trains, built from its config: loaded through the adapter, its window extended,
LoRA applied, parameters frozen by module group, attention chosen, sequence parallelism set up.

What :meth:`SFTRecipe.setup <mmtune.training.loop.SFTRecipe.setup>` builds before the engine
shards the model; nothing here knows the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mmtune.training.layout import RankLayout

__all__ = ["BuiltModel", "build_model", "choose_attention"]


@dataclass
class BuiltModel:
    """A loaded, prepared model and what the loop asks about it."""

    adapter: Any
    model: torch.nn.Module
    groups: Any
    """The adapter's ``module_groups`` of the model (after LoRA)."""
    context_extension: Any
    """The RoPE extension applied (``None``: the model's own window)."""
    max_length: int
    """The training window: the context group's target when it extends the model, else ``collator.max_length``."""
    attention: Any
    """The resolved ``training.packed_attention`` (:mod:`mmtune.training.packed_attention`)."""
    language_model: Any
    sequence_parallel: Optional[Any]
    """The step context of ``training.sequence_parallel.size > 1``, else ``None``."""


def _refuse_sequence_parallel_heads(model_cfg: Any, adapter: Any, size: int) -> None:
    """Refuse a sequence-parallel size the model's heads do not divide by, before its weights load."""
    from mmtune.training.sequence_parallel.groups import planned_head_problems

    problems = planned_head_problems(model_cfg, adapter, size)
    if problems:
        raise ValueError("training.sequence_parallel cannot run: " + "; ".join(problems) + "; choose a size that "
                         "divides them")


def _load(cfg: Any) -> tuple[Any, torch.nn.Module]:
    """The adapter and its model; random-weight models are seeded identically on every rank."""
    from mmtune.models.registry import build_adapter
    from mmtune.training.peft_setup import qlora_load_kwargs

    t = cfg.training
    adapter = build_adapter(cfg.model)
    if t.sequence_parallel.size > 1:  # the heads split over the group, from the config alone
        _refuse_sequence_parallel_heads(cfg.model, adapter, t.sequence_parallel.size)
    load_kwargs: dict[str, Any] = {"seed": t.seed} if cfg.model.path is None else {}
    if cfg.peft.method == "qlora":
        load_kwargs.update(qlora_load_kwargs(cfg.peft, torch.bfloat16 if t.mixed_precision == "bf16" else torch.float16,
                                             skip_modules=adapter.quantization_skip_modules()))
    return adapter, adapter.load_model(**load_kwargs)


def build_model(cfg: Any, layout: RankLayout) -> BuiltModel:
    """Load the model through the adapter, extend its context, apply LoRA, freeze, choose attention.

    Args:
        cfg: the run's ``SFTConfig``.
        layout: the run's rank layout (its sequence-parallel size).

    Raises:
        ValueError: when the training window exceeds the model's context window, or
            ``training.packed_attention=per_sample`` cannot work with the model.
    """
    from mmtune.models.rope import apply_context_extension
    from mmtune.training.optim import apply_freezing
    from mmtune.training.peft_setup import apply_lora

    t = cfg.training
    adapter, model = _load(cfg)
    text_config = adapter.text_config(model.config)
    extension = apply_context_extension(
        model, text_config, cfg.context,
        model_max_position_embeddings=cfg.model.max_position_embeddings, tokenizer=adapter.tokenizer)
    max_length = cfg.context.max_length or cfg.collator.max_length
    window = max(int(text_config.max_position_embeddings),
                 extension.target if extension else 0)  # dynamic NTK keeps the original
    if max_length > window:
        raise ValueError(
            f"samples of up to {max_length} tokens (collator.max_length / context.max_length) exceed the "
            f"model's {window}-token window: lower collator.max_length or extend the window with context=8k")
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    lora = cfg.peft.method in ("lora", "qlora")
    if lora:
        model = apply_lora(model, adapter.module_groups(model), cfg.peft, adapter.default_lora_targets,
                           gradient_checkpointing=t.gradient_checkpointing)
    groups = adapter.module_groups(model)
    apply_freezing(model, groups, t, lora=lora)
    attention, language_model = choose_attention(model, text_config, t.packed_attention, cfg.collator.batching)
    sequence_parallel = None
    if layout.sequence_parallel > 1:
        from mmtune.training.sequence_parallel import SequenceParallel

        sequence_parallel = SequenceParallel.create(layout.sequence_parallel, adapter, model,
                                                    attn_implementation=text_config._attn_implementation)
    return BuiltModel(adapter=adapter, model=model, groups=groups, context_extension=extension, max_length=max_length,
                      attention=attention, language_model=language_model, sequence_parallel=sequence_parallel)


def choose_attention(model: torch.nn.Module, text_config: Any, mode: str, batching: str) -> tuple[Any, Any]:
    """Resolve ``training.packed_attention`` (``mode``) against the loaded model (see
    :mod:`mmtune.training.packed_attention`); ``auto`` falls back, saying why, where the
    language model cannot switch, ``per_sample`` fails.

    Returns:
        The resolved attention and the language model whose attention it switches.
    """
    from mmtune.training.packed_attention import fallback, language_model, model_support_problem, resolve_attention

    attention = resolve_attention(mode, batching=batching, attn_implementation=text_config._attn_implementation)
    lm = language_model(model, text_config)
    if attention.per_sample:
        problem = model_support_problem(model, text_config)
        if problem and mode == "per_sample":
            raise ValueError(f"training.packed_attention=per_sample cannot work with this model: {problem}; "
                             "set training.packed_attention=auto (transformers' block mask) or off")
        if problem:
            attention = fallback(attention, problem)
    return attention, lm

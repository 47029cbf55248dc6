"""Context extension: longer training windows through RoPE scaling.

MMDU trains LLaVA-1.5 (a 4k-window Vicuna) on dialogues of up to 8k-16k tokens. The
paper interpolates RoPE positions; this module sets the scaling on the language model's
(nested) text config and rebuilds the rotary-embedding modules, because transformers
computes ``inv_freq`` and the attention scaling once, when the module is built —
editing the config of an already-built model would otherwise change nothing.

Scaling types (``rope_scaling``):

- ``linear`` (default, the paper's choice): positions are divided by ``factor``, i.e.
  ``inv_freq / factor``. Cheap to fine-tune into; every position is squeezed equally.
- ``dynamic`` (dynamic NTK): the base grows with the sequence length once it exceeds the
  original window; sequences within the original window are untouched.
- ``yarn``: interpolates low frequencies, keeps high ones, and rescales attention by
  ``0.1 * ln(factor) + 1``; usually the best long-context quality after fine-tuning.

``factor = target / original`` where ``original`` is
:attr:`ContextConfig.original_max_position_embeddings`, else
``ModelConfig.max_position_embeddings``, else the text config's
``max_position_embeddings`` (4096 for Vicuna v1.5).

Example::

    extension = apply_context_extension(model, adapter.text_config(model.config),
                                        ContextConfig(max_length=8192))
    # extension.factor == 2.0 for a 4k model; model.config is saved with the scaling
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

__all__ = ["ContextConfig", "ContextExtension", "rope_parameters_for", "apply_context_extension", "rebuild_rotary_embeddings"]

ROPE_SCALINGS = ("linear", "dynamic", "yarn", "none")


@dataclass
class ContextConfig:
    """The ``context/`` config group: training window and RoPE scaling."""

    max_length: Optional[int] = None
    """Training window in tokens (after image-token expansion). ``None`` keeps the model's
    original window and changes no RoPE setting."""
    rope_scaling: str = "linear"
    """``linear`` (paper default), ``dynamic`` (NTK), ``yarn``, or ``none`` (raise only
    ``max_position_embeddings``, as the public MMDU LLaVA script does)."""
    original_max_position_embeddings: Optional[int] = None
    """Window the model was pretrained with; ``None`` reads ``ModelConfig.max_position_embeddings``
    and then the text config. Needed when a checkpoint's config already had it raised."""
    yarn_beta_fast: Optional[float] = None
    """YaRN ``beta_fast`` (transformers default 32 when ``None``)."""
    yarn_beta_slow: Optional[float] = None
    """YaRN ``beta_slow`` (transformers default 1 when ``None``)."""


@dataclass(frozen=True)
class ContextExtension:
    """What :func:`apply_context_extension` did (logged, and written to ``mmtune_run.json``)."""

    original: int
    target: int
    rope_type: str
    factor: float
    rotary_modules_rebuilt: int


def rope_parameters_for(current: dict[str, Any], *, rope_scaling: str, factor: float, original: int,
                        beta_fast: Optional[float] = None, beta_slow: Optional[float] = None) -> dict[str, Any]:
    """The new ``rope_parameters`` dict for ``rope_scaling`` at ``factor``.

    Keeps ``rope_theta`` (and ``partial_rotary_factor``) from ``current``; only the keys
    transformers' validator accepts for each type are written, so no warnings follow.
    """
    keep = {k: current[k] for k in ("rope_theta", "partial_rotary_factor") if k in current}
    if rope_scaling == "none" or factor <= 1.0:
        # The target fits the pretrained window: leave the model's own RoPE as it is
        # (e.g. InternLM2's dynamic scaling with factor 1.0 keeps its factor key).
        return dict(current) if current else {"rope_type": "default"}
    if rope_scaling in ("linear", "dynamic"):
        return {**keep, "rope_type": rope_scaling, "factor": float(factor)}
    if rope_scaling == "yarn":
        params = {**keep, "rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
        if beta_fast is not None:
            params["beta_fast"] = float(beta_fast)
        if beta_slow is not None:
            params["beta_slow"] = float(beta_slow)
        return params
    raise ValueError(f"context.rope_scaling={rope_scaling!r} is not one of {ROPE_SCALINGS}")


def _original_window(text_config: Any, context: ContextConfig, model_max_position_embeddings: Optional[int]) -> int:
    for value in (context.original_max_position_embeddings, model_max_position_embeddings):
        if value is not None:
            return int(value)
    params = getattr(text_config, "rope_parameters", None) or {}
    if "original_max_position_embeddings" in params:
        return int(params["original_max_position_embeddings"])
    value = getattr(text_config, "max_position_embeddings", None)
    if value is None:
        raise ValueError(
            f"{type(text_config).__name__} has no max_position_embeddings; set "
            "context.original_max_position_embeddings (or model.max_position_embeddings) to the pretrained window"
        )
    return int(value)


def rebuild_rotary_embeddings(model: nn.Module, text_config: Any) -> int:
    """Re-create every rotary-embedding module built from ``text_config``.

    Rotary modules (``LlamaRotaryEmbedding`` and friends) compute ``inv_freq`` and
    ``attention_scaling`` in ``__init__`` from ``config.rope_parameters``; rebuilding them
    is the only way a config change reaches the forward pass. Returns the number rebuilt.
    """
    replaced = 0
    for name, module in list(model.named_modules()):
        if getattr(module, "config", None) is not text_config or not hasattr(module, "inv_freq"):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        rebuilt = type(module)(text_config).to(module.inv_freq.device)
        setattr(parent, child, rebuilt)
        replaced += 1
    return replaced


def apply_context_extension(model: nn.Module, text_config: Any, context: ContextConfig, *,
                            model_max_position_embeddings: Optional[int] = None,
                            tokenizer: Any = None) -> Optional[ContextExtension]:
    """Set the training window and RoPE scaling on ``text_config`` and rebuild the rotary modules.

    Args:
        model: the loaded model whose rotary modules were built from ``text_config``.
        text_config: ``adapter.text_config(model.config)`` (the nested language-model config).
        context: the ``context`` config group.
        model_max_position_embeddings: ``ModelConfig.max_position_embeddings`` (original window override).
        tokenizer: its ``model_max_length`` is set to the target window.

    Returns:
        What was changed, or ``None`` when ``context.max_length`` is ``None``.

    Raises:
        ValueError: unknown ``rope_scaling`` or no way to know the original window.
    """
    if context.max_length is None:
        return None
    if context.rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"context.rope_scaling={context.rope_scaling!r} is not one of {ROPE_SCALINGS}")
    original = _original_window(text_config, context, model_max_position_embeddings)
    target = int(context.max_length)
    factor = max(1.0, target / original)
    current = dict(getattr(text_config, "rope_parameters", None) or {})
    new_params = rope_parameters_for(current, rope_scaling=context.rope_scaling, factor=factor, original=original,
                                     beta_fast=context.yarn_beta_fast, beta_slow=context.yarn_beta_slow)
    text_config.rope_parameters = new_params
    # Dynamic NTK measures growth against max_position_embeddings, so it must stay the
    # original window; linear/YaRN/none declare the new window there.
    text_config.max_position_embeddings = original if new_params["rope_type"] == "dynamic" else max(target, original)
    if tokenizer is not None:
        tokenizer.model_max_length = target
    rebuilt = rebuild_rotary_embeddings(model, text_config)
    return ContextExtension(original=original, target=target, rope_type=new_params["rope_type"],
                            factor=factor if new_params["rope_type"] != "default" else 1.0,
                            rotary_modules_rebuilt=rebuilt)

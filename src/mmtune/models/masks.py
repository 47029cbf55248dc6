"""Attention masks of packed rows that transformers gets wrong, fixed by a forward pre-hook.

Shared by every family whose language model has sliding-window layers (Gemma 3, Cohere2 of Aya
Vision): :func:`install_packed_window_masks` registers :func:`packed_window_masks` on the decoder
when the text config names sliding-window layers.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["install_packed_guards", "install_packed_window_masks", "packed_window_masks", "PackedLinearAttentionError", "refuse_packed_linear_attention"]


def packed_window_masks(module, args, kwargs, *, window: int):
    """Forward pre-hook of a language model with sliding-window layers: on a packed row (positions
    restarting, no cache), its sliding-window mask becomes its full-attention mask within the window.

    Why: transformers builds the full-attention mask of a packed row right (each sample causal,
    Gemma 3's images bidirectional by ``token_type_ids``), but composes the sliding one with the
    image-block overlay applied before the per-sample position remap, so on every sample after the
    first it reads the image blocks at the wrong tokens (Gemma 3: 1.3e-4 off the samples alone). A
    sliding layer's mask is the full one within the window (transformers: "AND(sliding_window,
    OR(causal, blockwise))"), and within one sample the window counts tokens, so this is each
    sample's own sliding mask."""
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    masks, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    cached = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(masks, dict) or cached is not None or positions is None:
        return None
    full, sliding = masks.get("full_attention"), masks.get("sliding_attention")
    if not (isinstance(full, torch.Tensor) and isinstance(sliding, torch.Tensor) and full.ndim == 4
            and full.shape[-1] == full.shape[-2]):
        return None
    if positions.ndim != 2 or find_packed_sequence_indices(positions) is None:
        return None  # one sample per row: transformers' own masks are right
    length = int(full.shape[-1])
    index = torch.arange(length, device=full.device)
    inside = (index[:, None] - index[None, :]) < window  # query minus key, as transformers' window overlay
    if full.dtype == torch.bool:
        fixed = full & inside
    else:  # an additive float mask (eager)
        fixed = full.masked_fill(~inside, torch.finfo(full.dtype).min)
    return args, {**kwargs, "attention_mask": {**masks, "sliding_attention": fixed}}



def install_packed_window_masks(model: Any, text_config: Any) -> None:
    """Register :func:`packed_window_masks` on ``model``'s decoder where ``text_config`` has
    sliding-window layers (nothing otherwise)."""
    window = getattr(text_config, "sliding_window", None)
    if window and "sliding_attention" in (getattr(text_config, "layer_types", None) or []):
        model.get_decoder().register_forward_pre_hook(
            functools.partial(packed_window_masks, window=int(window)), with_kwargs=True)


class PackedLinearAttentionError(ValueError):
    """A packed row reached a language model with linear-attention layers."""


def refuse_packed_linear_attention(module, args, kwargs):
    """Forward pre-hook of a language model with linear-attention layers (Qwen3.5's Gated DeltaNet):
    refuse a packed row (positions restarting, no cache). Its recurrent state and short convolution
    run across the whole row, so a packed sample would read the samples before it: not exact."""
    from transformers.masking_utils import find_packed_sequence_indices

    positions = kwargs.get("position_ids")
    if kwargs.get("cache", kwargs.get("past_key_values")) is not None or positions is None:
        return None
    if kwargs.get("attention_mask") is not None:  # padded rows carry their mask; packed rows none
        return None
    text = positions[0] if positions.ndim == 3 else positions  # M-RoPE: the text row first
    if text.ndim == 2 and find_packed_sequence_indices(text) is not None:
        raise PackedLinearAttentionError(
            f"{type(module).__name__} has linear-attention layers, whose recurrent state would run from one packed "
            "sample into the next; train it without packing (collator.batching other than packing)")
    return None


def install_packed_guards(model: Any, text_config: Any) -> None:
    """The packed-row hooks ``model``'s decoder needs: :func:`packed_window_masks` for sliding-window
    layers, :func:`refuse_packed_linear_attention` for linear-attention ones."""
    install_packed_window_masks(model, text_config)
    if "linear_attention" in (getattr(text_config, "layer_types", None) or []):
        model.get_decoder().register_forward_pre_hook(refuse_packed_linear_attention, with_kwargs=True)

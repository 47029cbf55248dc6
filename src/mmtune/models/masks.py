"""Attention masks of packed rows that transformers gets wrong, fixed by a forward pre-hook.

Shared by every family whose language model has sliding-window layers (Gemma 3, Cohere2 of Aya
Vision): :func:`install_packed_window_masks` registers :func:`packed_window_masks` on the decoder
when the text config names sliding-window layers; a language model with layers a packed row is not
exact under (:func:`unpackable_layer_types`) gets :func:`refuse_packed_rows` instead.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

__all__ = ["PACKABLE_LAYER_TYPES", "PackedStateLayersError", "install_packed_guards", "install_packed_window_masks",
           "packed_window_masks", "refuse_packed_rows", "unpackable_layer_types"]


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


#: the layer kinds (a text config's ``layer_types``) a packed row is exact under: positions restart per
#: sample, sliding windows are fixed by :func:`packed_window_masks`, chunked attention keeps transformers'
#: block mask. Any other kind transformers names (``linear_attention``: Gated DeltaNet, Mamba; ``conv``:
#: LFM2's short convolution; ``hybrid``; compressed, indexed or sparse attention over blocks of keys)
#: carries state or blocks from one packed sample into the next.
PACKABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def unpackable_layer_types(text_config: Any) -> list[str]:
    """The kinds of ``text_config``'s layers a packed row is not exact under (none: ``[]``)."""
    return sorted(set(getattr(text_config, "layer_types", None) or []) - PACKABLE_LAYER_TYPES)


class PackedStateLayersError(ValueError):
    """A packed row reached a language model with layers that read across a packed sample's start."""


def refuse_packed_rows(module, args, kwargs, kinds: Sequence[str] = ()):
    """Forward pre-hook of a language model with layers of :func:`unpackable_layer_types` (Qwen3.5's
    Gated DeltaNet ``linear_attention``, LFM2's ``conv``): refuse a packed row (positions restarting, no
    cache). Their recurrent state, short convolution or key blocks run across the whole row, so a packed
    sample would read the samples before it: not exact."""
    from transformers.masking_utils import find_packed_sequence_indices

    positions = kwargs.get("position_ids")
    if kwargs.get("cache", kwargs.get("past_key_values")) is not None or positions is None:
        return None
    if kwargs.get("attention_mask") is not None:  # padded rows carry their mask; packed rows none
        return None
    text = positions[0] if positions.ndim == 3 else positions  # M-RoPE: the text row first
    if text.ndim == 2 and find_packed_sequence_indices(text) is not None:
        raise PackedStateLayersError(
            f"{type(module).__name__} has layers of kinds {list(kinds)} (recurrent state, short convolutions or "
            "blocks of keys), which would read from one packed sample into the next; train it without packing "
            "(collator.batching other than packing)")
    return None


def install_packed_guards(model: Any, text_config: Any) -> None:
    """The packed-row hooks ``model``'s decoder needs: :func:`packed_window_masks` for sliding-window
    layers, :func:`refuse_packed_rows` for layers of :func:`unpackable_layer_types`."""
    install_packed_window_masks(model, text_config)
    kinds = unpackable_layer_types(text_config)
    if kinds:
        model.get_decoder().register_forward_pre_hook(functools.partial(refuse_packed_rows, kinds=kinds),
                                                      with_kwargs=True)

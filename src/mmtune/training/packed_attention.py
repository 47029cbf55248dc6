"""Attention over packed rows at the cost of their samples: SDPA (or eager) run once per sample.

Why: a packed row of ``L`` tokens holding samples of lengths ``l_1 .. l_k`` needs only
``sum(l_i²)`` attention scores, but with SDPA or eager attention transformers builds a
``[B, 1, L, L]`` block-diagonal mask from the restarting ``position_ids``
(``masking_utils.find_packed_sequence_indices``) and the kernel computes all ``L²``
scores and then masks most of them away: an 8k row of ten 800-token samples pays ten
times the attention work of its samples, plus the 64 MiB mask. FlashAttention-2's varlen
kernel skips the cross-sample blocks, but it needs the flash-attn package and a GPU;
PyTorch's FlexAttention has no backward pass on CPU (torch 2.13).

How: two implementations registered in transformers' attention registries
(``AttentionInterface`` and ``AttentionMaskInterface``, see the transformers docs page
"Attention Interface"), one per base kernel:

``mmtune_packed_sdpa`` / ``mmtune_packed_eager``
    The *mask* function receives the mask pattern transformers composed for the batch
    (causal, restricted to each packed sample) and, instead of expanding it to ``L x L``,
    evaluates it on the diagonals only (``O(L)``): where token ``t`` does not see token
    ``t - 1`` a new sample starts. It returns those boundaries as a
    :class:`PackedSegments` in place of a mask. Every layer's *attention* function then
    runs the base kernel (transformers' own ``sdpa_attention_forward``, or the Llama
    ``eager_attention_forward`` that mmtune's InternLM-XComposer2 also uses) on each
    sample's slice with a plain causal mask; samples of one short length share a call.

Everything else goes through the base kernel unchanged: a padding mask, a KV cache, a
batch without packed rows, or a pattern that is not plain causal attention inside each
sample (a sliding window or a chunked layer, which transformers' mask builders announce;
a bidirectional image block, which the diagonals show) gets exactly the mask and the
kernel the base implementation would use. So the switch changes how much work packed
rows cost, not what the model computes (up to float rounding).

Selection (``training.packed_attention``, resolved by :func:`resolve_attention`, printed
at start-up and by ``mmtune plan``): ``auto`` switches the language model to the packed
implementation when ``collator.batching=packing`` and ``model.attn_implementation`` is
``sdpa`` or ``eager``; ``flash_attention_2`` keeps its own varlen path; ``off`` keeps
transformers' block mask; ``per_sample`` insists and fails at start-up where it cannot
work. The loop switches it on for the training steps only (:func:`use_attention`):
in-training evaluation and generation run with the configured implementation.

Example::

    plan = resolve_attention("auto", batching="packing", attn_implementation="sdpa")
    lm = language_model(model, adapter.text_config(model.config))
    with use_attention(lm, plan.training_implementation):
        loss = model(**model_inputs(packed_batch)).loss
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

#: values of ``training.packed_attention``
PACKED_ATTENTION_MODES = ("auto", "per_sample", "off")

__all__ = [
    "PACKED_ATTENTION_MODES",
    "PACKED_IMPLEMENTATIONS",
    "AttentionPlan",
    "PackedSegments",
    "fallback",
    "language_model",
    "model_support_problem",
    "per_sample_attention",
    "register_packed_attention",
    "resolve_attention",
    "use_attention",
]

#: base implementation -> the packed implementation registered for it
PACKED_IMPLEMENTATIONS = {"sdpa": "mmtune_packed_sdpa", "eager": "mmtune_packed_eager"}

#: Samples of one length up to this many tokens share one kernel call. Measured on CPU
#: (one thread, 12 heads of 64, forward and backward): one stacked call takes 0.16x (1-token
#: samples) to 0.8x (8 tokens) the time of a call per sample, about the same at 12 tokens,
#: and from 16 tokens on stacking the slices costs more than the calls it saves.
GROUP_MAX_LENGTH = 8


# -------------------------------------------------------------------------------------------------
# Selection
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """What the language model's attention runs during training, resolved from the config."""

    implementation: str
    """``model.attn_implementation`` (what evaluation and generation use)."""
    training_implementation: str
    """What the training steps use: a packed implementation or ``implementation`` itself."""
    description: str
    """The start-up line's and ``mmtune plan``'s words for it."""

    @property
    def per_sample(self) -> bool:
        return self.training_implementation != self.implementation


def resolve_attention(mode: str, *, batching: str, attn_implementation: str) -> AttentionPlan:
    """The attention a run trains with (see the module docstring); no model needed.

    Raises:
        ValueError: ``mode`` is unknown, or ``per_sample`` was asked for where it cannot
            work (batches that are not packed, a kernel other than sdpa/eager); the
            message names the keys to change.
    """
    if mode not in PACKED_ATTENTION_MODES:
        raise ValueError(f"training.packed_attention={mode!r}: use one of {', '.join(PACKED_ATTENTION_MODES)}")
    impl = attn_implementation
    packing = batching == "packing"
    if mode == "per_sample":
        problems = []
        if not packing:
            problems.append(f"collator.batching={batching} has no packed rows (each sample is its own row with a "
                            "padding mask); use collator.batching=packing")
        if impl not in PACKED_IMPLEMENTATIONS:
            hint = ("flash_attention_2 already attends per sample through its varlen kernel"
                    if impl.startswith("flash_attention") else "use model.attn_implementation=sdpa or eager")
            problems.append(f"model.attn_implementation={impl} has no per-sample variant: {hint}")
        if problems:
            raise ValueError("training.packed_attention=per_sample cannot work here: " + "; ".join(problems)
                             + "; or set training.packed_attention=auto")
    if not packing:
        return AttentionPlan(impl, impl, f"{impl} ({batching} batches: one sample per row, padding masks)")
    if impl.startswith("flash_attention"):
        return AttentionPlan(impl, impl, f"{impl} varlen over packed rows (sample boundaries from position_ids)")
    if impl not in PACKED_IMPLEMENTATIONS:
        return AttentionPlan(impl, impl, f"{impl} with transformers' own mask for packed rows (no per-sample "
                                         f"variant of {impl})")
    if mode == "off":
        return AttentionPlan(impl, impl, f"{impl} with transformers' block-diagonal [B, 1, L, L] mask over packed "
                                         "rows (training.packed_attention=off): every row pays L² attention scores")
    return AttentionPlan(impl, PACKED_IMPLEMENTATIONS[impl],
                         f"{impl} per sample over packed rows ({PACKED_IMPLEMENTATIONS[impl]}, "
                         f"training.packed_attention={mode}): no block mask, each sample's own attention cost")


def fallback(plan: AttentionPlan, reason: str) -> AttentionPlan:
    """``plan`` with the configured implementation kept, saying why (``auto`` on a model that cannot switch)."""
    impl = plan.implementation
    return AttentionPlan(impl, impl, f"{impl} with transformers' block-diagonal mask over packed rows "
                                     f"(per-sample attention unavailable: {reason})")


def language_model(model: nn.Module, text_config: Any) -> Optional[nn.Module]:
    """The ``PreTrainedModel`` inside ``model`` (possibly wrapped) whose config is ``text_config``."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config is text_config:
            return module
    return None


def model_support_problem(model: nn.Module, text_config: Any) -> str:
    """Why the language model of ``model`` cannot take a packed implementation ("" when it can).

    It must route attention through transformers' registry (``_supports_attention_backend``,
    what transformers itself checks before swapping kernels) and attend to the whole causal
    past: a sliding window or chunked layers would need the windows inside each sample.
    """
    lm = language_model(model, text_config)
    if lm is None:
        return f"no language model with the text config ({type(text_config).__name__}) found in {type(model).__name__}"
    if not getattr(lm, "_supports_attention_backend", False) or not lm._can_set_attn_implementation():
        return (f"{type(lm).__name__} does not call its attention through transformers' AttentionInterface, so its "
                "kernel cannot be swapped")
    window = getattr(text_config, "sliding_window", None)
    layer_types = set(getattr(text_config, "layer_types", None) or ["full_attention"])
    if window is not None or layer_types - {"full_attention"}:
        return (f"{type(lm).__name__} has windowed attention layers (sliding_window={window}, layer types "
                f"{sorted(layer_types)})")
    return ""


@contextlib.contextmanager
def use_attention(lm: nn.Module, implementation: str) -> Iterator[None]:
    """Run ``lm`` (a ``PreTrainedModel``) with ``implementation`` inside the block, then restore it.

    Uses transformers' ``set_attn_implementation``, which checks the model supports it;
    the config key is not saved with checkpoints, so nothing of this leaks into ``final/``.
    """
    before = lm.config._attn_implementation
    if implementation == before:
        yield
        return
    if implementation in PACKED_IMPLEMENTATIONS.values():
        register_packed_attention()
    lm.set_attn_implementation(implementation)
    try:
        yield
    finally:
        lm.set_attn_implementation(before)


# -------------------------------------------------------------------------------------------------
# The sample boundaries (built once per forward, read by every layer)
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedSegments:
    """The samples of packed rows, handed to the attention function in place of a mask.

    ``lengths[r]`` are row ``r``'s sample lengths in order (they sum to ``length``); row
    padding is a sample of its own (the collator gives it its own run of positions).
    ``groups`` maps a length to the ``(row, index in row)`` of every sample that long.
    """

    rows: int
    length: int
    lengths: tuple[tuple[int, ...], ...]
    groups: dict[int, list[tuple[int, int]]] = field(repr=False, compare=False)

    @classmethod
    def from_starts(cls, starts: list[list[int]], length: int) -> "PackedSegments":
        """From each row's sample starts (``0`` first, increasing)."""
        lengths = tuple(tuple(e - s for s, e in zip(row, row[1:] + [length])) for row in starts)
        groups: dict[int, list[tuple[int, int]]] = {}
        for r, row in enumerate(lengths):
            for j, n in enumerate(row):
                groups.setdefault(n, []).append((r, j))
        return cls(len(starts), length, lengths, groups)


def _segments_of(mask_function: Callable, batch_size: int, length: int, device: Any) -> Optional[PackedSegments]:
    """The packed samples of ``mask_function``'s pattern, or ``None`` when it is not exactly
    causal attention inside each of several samples (then the base mask is built).

    A mask function answers "may query ``q`` see key ``kv``" for index tensors (the
    form transformers' non-vmap mask expansion calls it in). Three diagonals decide:
    every token sees itself, no token sees its successor (nothing bidirectional), and
    token ``t`` sees ``t - 1`` exactly when both are in the same sample. Inside a sample
    the causal pattern then holds for every pair: the only pieces transformers composes
    without ``use_vmap`` are the causal rule, the packed-sample rule and overlays that
    open blocks (which the successor diagonal catches).
    """
    if length < 2:
        return None
    rows = torch.arange(batch_size, device=device)[:, None]
    head = torch.zeros((1, 1), dtype=torch.long, device=device)
    q = torch.arange(length, device=device)[None, :]
    sees_self = mask_function(rows, head, q, q)
    sees_next = mask_function(rows, head, q[:, :-1], q[:, 1:])
    sees_previous = mask_function(rows, head, q[:, 1:], q[:, :-1])
    if not (torch.as_tensor(sees_self).all() and not torch.as_tensor(sees_next).any()):
        return None
    new_sample = ~torch.as_tensor(sees_previous).expand(batch_size, length - 1)
    if not new_sample.any():
        return None  # one sample per row: the base path (no mask for sdpa) is already cheap
    starts: list[list[int]] = [[0] for _ in range(batch_size)]
    for row, col in new_sample.nonzero().tolist():
        starts[row].append(col + 1)
    return PackedSegments.from_starts(starts, length)


def _is_zero(offset: Any) -> bool:
    return isinstance(offset, int) and offset == 0


def _packed_mask(base: str) -> Callable:
    """The mask function of the packed variant of ``base``: boundaries for packed rows, else the base mask."""

    def mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function: Optional[Callable] = None, attention_mask: Optional[torch.Tensor] = None,
             local_size: Optional[int] = None, use_vmap: bool = False, device: Any = "cpu", **kwargs: Any):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function

        mask_function = mask_function or causal_mask_function
        causal_builder = "allow_is_bidirectional_skip" not in kwargs  # create_bidirectional_mask passes it
        if (attention_mask is None and local_size is None and not use_vmap and causal_builder
                and q_length == kv_length and _is_zero(q_offset) and _is_zero(kv_offset)):
            segments = _segments_of(mask_function, batch_size, q_length, device)
            if segments is not None:
                return segments
        return ALL_MASK_ATTENTION_FUNCTIONS[base](
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap,
            device=device, **kwargs)

    mask.__name__ = f"packed_{base}_mask"
    # Python dispatch on each batch's sample layout: compiled graphs would guard on it and
    # recompile for every new layout, so it runs eagerly between them.
    return torch.compiler.disable(mask)


# -------------------------------------------------------------------------------------------------
# The attention function
# -------------------------------------------------------------------------------------------------

#: keyword arguments that change attention in ways a per-sample causal call would drop
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")


def _base_function(base: str) -> Callable:
    if base == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    # Eager attention is each model's own function, not a registry entry; Llama's is the
    # plain one (grouped-query heads, scaling, dropout) and what mmtune's XComposer2 uses.
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def _packed_attention(base: str) -> Callable:
    """The attention function of the packed variant of ``base``."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any):
        function = _base_function(base)
        if not isinstance(attention_mask, PackedSegments):
            return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        segments = attention_mask
        batch, _, length, _ = query.shape
        if (batch, length) != (segments.rows, segments.length) or key.shape[2] != length:
            raise ValueError(
                f"packed attention: query [{batch}, {length}] and keys of length {key.shape[2]} do not match the "
                f"packed rows [{segments.rows}, {segments.length}] the mask was built for")
        present = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
        if present:
            raise ValueError(f"{type(module).__name__} passes {', '.join(present)} to its attention, which the "
                             f"per-sample implementation does not apply; set training.packed_attention=off")
        causal = kwargs.pop("is_causal", None)
        causal = getattr(module, "is_causal", True) if causal is None else causal
        # One split per row, not a slice per sample: a slice's backward writes a zero tensor of
        # the whole row, a split's backward concatenates the pieces' gradients once.
        pieces = [[t.split(segments.lengths[r], dim=1) for t in (query[r], key[r], value[r])]
                  for r in range(batch)]
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        for size, members in segments.groups.items():
            step = len(members) if size <= GROUP_MAX_LENGTH else 1
            for first in range(0, len(members), step):
                chunk = members[first:first + step]
                q, k, v = (torch.stack([pieces[r][i][j] for r, j in chunk]) for i in range(3))
                mask = _causal_additive(size, q) if base == "eager" and causal and size > 1 else None
                out, _ = function(module, q, k, v, mask, dropout=dropout, scaling=scaling, is_causal=causal, **kwargs)
                outputs.update(zip(chunk, out))  # out: [n, size, heads, head_dim]
        rows = [torch.cat([outputs[(r, j)] for j in range(len(segments.lengths[r]))]) for r in range(batch)]
        return torch.stack(rows), None

    attention.__name__ = f"packed_{base}_attention"
    return torch.compiler.disable(attention)


def per_sample_attention(base: str) -> Callable:
    """The attention function of the packed variant of ``base`` (``sdpa`` or ``eager``): called
    with a :class:`PackedSegments` in place of the mask, it attends inside each sample."""
    return _packed_attention(base)


def _causal_additive(size: int, like: torch.Tensor) -> torch.Tensor:
    """``[1, 1, size, size]`` additive causal mask as eager attention adds it: 0 where a key is
    seen, the dtype's minimum above the diagonal."""
    blocked = torch.ones(size, size, dtype=torch.bool, device=like.device).triu(1)
    mask = torch.zeros(size, size, dtype=like.dtype, device=like.device)
    return mask.masked_fill(blocked, torch.finfo(like.dtype).min)[None, None]


def register_packed_attention() -> None:
    """Register ``mmtune_packed_sdpa`` and ``mmtune_packed_eager`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for base, name in PACKED_IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _packed_attention(base))
        AttentionMaskInterface.register(name, _packed_mask(base))

"""The Ulysses exchange: attention over a whole row whose tokens are spread over ``N`` ranks.

Each rank holds ``L/N`` tokens of the row and, after its projections, their queries,
keys and values for all ``H`` heads. One ``all_to_all_single`` turns that into all ``L``
tokens for ``H/N`` heads (rank ``j`` gets heads ``j H/N .. (j+1) H/N - 1``, and the key/value
heads that serve them), the rank runs ordinary attention on its heads over the whole
row, and a second ``all_to_all_single`` gives every rank back its own tokens with all
heads. This is the exchange of Ulysses (Jacobs et al., 2023, arXiv:2309.14509), written
here as two autograd functions on ``torch.distributed`` collectives, which also run on gloo
CPU ranks.
The backward of each exchange is the other exchange.

The local attention is mmtune's per-sample attention
(:mod:`mmtune.training.packed_attention`) over the whole row's sample boundaries, on
transformers' own ``sdpa`` or ``eager`` kernel; it is registered in transformers'
attention registry as ``mmtune_ulysses_sdpa`` / ``mmtune_ulysses_eager``, and the model
reaches it through its ordinary ``AttentionInterface`` lookup. The row's boundaries and
the group travel to every layer as the keyword argument ``sequence_parallel``
(:class:`UlyssesContext`), which transformers hands from the language model's forward to
each attention call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from mmtune.training.packed_attention import PackedSegments, per_sample_attention

__all__ = ["ULYSSES_IMPLEMENTATIONS", "UlyssesContext", "heads_to_sequence", "register_ulysses_attention",
           "sequence_to_heads"]

#: base implementation -> its Ulysses variant
ULYSSES_IMPLEMENTATIONS = {"sdpa": "mmtune_ulysses_sdpa", "eager": "mmtune_ulysses_eager"}


@dataclass(frozen=True)
class UlyssesContext:
    """What every attention call of one forward needs: the group and the whole row's samples."""

    group: Any
    size: int
    segments: PackedSegments


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 (``N`` equal chunks: chunk ``j`` goes to rank ``j``)."""
    x = x.contiguous()
    # empty_like would copy a permuted input's strides; the exchange writes memory in order
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    send = x.reshape(batch, size, heads // size, length, dim).transpose(0, 1)  # [N, B, H/N, L/N, D]
    got = _exchange(send, group)  # chunk j: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, dim)


def _heads_to_seq(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    send = x.reshape(batch, heads, size, length // size, dim).permute(2, 0, 1, 3, 4)  # [N, B, H/N, L/N, D]
    got = _exchange(send, group)  # chunk j: rank j's heads of my tokens
    return got.transpose(0, 1).reshape(batch, size * heads, length // size, dim)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
        ctx.size, ctx.group = size, group
        return _seq_to_heads(x, size, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, ctx.size, ctx.group), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
        ctx.size, ctx.group = size, group
        return _heads_to_seq(x, size, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.size, ctx.group), None, None


def sequence_to_heads(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[B, H, L/N, D]`` (this rank's tokens, every head) -> ``[B, H/N, L, D]`` (every token, this rank's heads)."""
    return _SequenceToHeads.apply(x, size, group)


def heads_to_sequence(x: torch.Tensor, size: int, group: Any) -> torch.Tensor:
    """``[B, H/N, L, D]`` -> ``[B, H, L/N, D]``: the inverse of :func:`sequence_to_heads`."""
    return _HeadsToSequence.apply(x, size, group)


def _ulysses_attention(base: str):
    local = per_sample_attention(base)

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                  sequence_parallel: Optional[UlyssesContext] = None, **kwargs: Any):
        if sequence_parallel is None:
            raise RuntimeError(f"{ULYSSES_IMPLEMENTATIONS[base]} was called without the sequence_parallel context; "
                               "it runs only inside SequenceParallel.step")
        sp = sequence_parallel
        for name, t in (("query", query), ("key/value", key)):
            if t.shape[1] % sp.size:
                raise ValueError(f"{type(module).__name__}: {t.shape[1]} {name} heads do not divide by the "
                                 f"sequence-parallel size {sp.size}")
        q, k, v = (sequence_to_heads(t, sp.size, sp.group) for t in (query, key, value))
        out, _ = local(module, q, k, v, sp.segments, dropout=dropout, scaling=scaling, **kwargs)
        out = heads_to_sequence(out.transpose(1, 2), sp.size, sp.group)  # out: [B, L, H/N, D] -> [B, H, L/N, D]
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"ulysses_{base}_attention"
    return torch.compiler.disable(attention)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask builder of the Ulysses implementations: none (the boundaries come with the context)."""
    return None


def register_ulysses_attention() -> None:
    """Register ``mmtune_ulysses_sdpa`` and ``mmtune_ulysses_eager`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for base, name in ULYSSES_IMPLEMENTATIONS.items():
        AttentionInterface.register(name, _ulysses_attention(base))
        AttentionMaskInterface.register(name, _no_mask)

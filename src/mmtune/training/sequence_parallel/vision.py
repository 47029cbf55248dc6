"""The vision encoder once per image across a sequence-parallel group.

Every rank of a group holds the same row and so the same images. Instead of each rank
encoding all of them, the images are shared out: largest first, each to the rank with
the least work so far (work = the image's input size, i.e. its patch count for Qwen2-VL's
variable-size images, the same for every image of a square-image family; ties go to the
lower rank, so every rank computes the same assignment). Each rank encodes its share,
the features are exchanged (an all-gather of the rows, padded to the longest share), and
every rank merges all of them into the row's embeddings as the model always does. In
the backward pass each rank's share receives the sum of every rank's gradient for it
(an all-reduce of the features' gradient), so its vision parameters get the gradient of
the whole row for its images, and the group's sum is the one-process gradient.

A rank whose share is empty (fewer images than ranks) still runs the encoder on the
smallest image and keeps none of the output: every rank calls the same modules each step,
which engines that shard the weights need.

It hooks the model's ``get_image_features`` (the transformers method a multimodal model's
forward calls to encode its images) for the duration of a step; the adapter says how the
batch's image inputs split into single images (``ModelAdapter.split_image_inputs``).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["encoder_modules", "share_images", "shared_image_features"]


def share_images(costs: Sequence[int], size: int) -> list[list[int]]:
    """Image indices per rank, balanced by ``costs`` (largest first to the least loaded rank);
    each rank's images in their row order."""
    load = [0] * size
    shares: list[list[int]] = [[] for _ in range(size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(size), key=lambda r: (load[r], r))
        shares[rank].append(index)
        load[rank] += costs[index]
    return [sorted(s) for s in shares]


class _GatherRows(torch.autograd.Function):
    """Every rank's ``[n_r, D]`` rows, concatenated in rank order; backward: the summed gradient of mine."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        longest = max(counts)
        padded = local.new_zeros((longest, *local.shape[1:]))
        padded[:local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded.contiguous(), group=group)
        return torch.cat([p[:n] for p, n in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        start = sum(ctx.counts[:ctx.rank])
        return grad[start:start + ctx.counts[ctx.rank]], None, None, None


def encoder_modules(model: nn.Module) -> list[nn.Module]:
    """The innermost modules of ``model`` with a ``get_image_features`` method (the ones whose
    forward encodes the images; outer wrappers only delegate to them)."""
    found = [m for m in model.modules() if callable(getattr(type(m), "get_image_features", None))]
    inner = []
    for module in found:
        if not any(other is not module and any(c is other for c in module.modules()) for other in found):
            inner.append(module)
    return inner


@contextlib.contextmanager
def shared_image_features(model: nn.Module, adapter: Any, size: int, rank: int, group: Any) -> Iterator[bool]:
    """Inside the block, ``model``'s image encoding is shared across the group (see the module
    docstring). Yields whether it could be (``False``: no ``get_image_features`` found, every
    rank encodes every image, which is as exact and only slower)."""
    modules = encoder_modules(model)
    if size == 1 or len(modules) != 1:
        yield False
        return
    module = modules[0]
    original = type(module).get_image_features
    signature = inspect.signature(original)  # of the class's function, ``self`` first
    names = list(adapter.image_input_names)
    missing = [n for n in names if n not in signature.parameters]
    if missing:
        yield False
        return

    def get_image_features(*args: Any, **kwargs: Any):
        bound = signature.bind(module, *args, **kwargs)
        inputs = {n: bound.arguments[n] for n in names}
        images = adapter.split_image_inputs(inputs)
        costs = [sum(int(t.numel()) for t in one.values()) for one in images]
        shares = share_images(costs, size)
        mine = shares[rank]
        chosen = mine or [min(range(len(images)), key=lambda i: (costs[i], i))]
        for n in names:
            bound.arguments[n] = torch.cat([images[i][n] for i in chosen])
        # every argument by keyword: the method's decorators fill config defaults by name
        named = {k: v for k, v in list(bound.arguments.items())[1:]
                 if signature.parameters[k].kind is not inspect.Parameter.VAR_KEYWORD}
        named.update(bound.kwargs)
        out = original(module, **named)
        features = getattr(out, "pooler_output", None)
        if not isinstance(features, (list, tuple)):
            raise TypeError(f"{type(module).__name__}.get_image_features returned no per-image pooler_output; "
                            "sequence parallelism cannot share its images")
        local = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
        if not mine:
            local = local[:0]  # ran for the sharded engines' sake; the gradient it gets is zero
        per_image = [int(f.reshape(-1, f.shape[-1]).shape[0]) for f in features] if mine else []
        every = [None] * size
        dist.all_gather_object(every, per_image, group=group)
        gathered = _GatherRows.apply(local, [sum(c) for c in every], rank, group)
        pieces = gathered.split([c for counts in every for c in counts])
        order = [i for share in shares for i in share]
        by_image: list[Any] = [None] * len(images)
        for index, piece in zip(order, pieces):
            by_image[index] = piece
        out.pooler_output = tuple(by_image)
        return out

    module.get_image_features = get_image_features  # shadows the class's method for this step only
    try:
        yield True
    finally:
        del module.get_image_features

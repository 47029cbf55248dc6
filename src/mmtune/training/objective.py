"""The training objective the loop calls: the token-weighted cross-entropy of a step, and the
vision tower run on every rank.

:class:`TokenWeightedCrossEntropy` is one object with two calls per optimizer step: first
:meth:`~TokenWeightedCrossEntropy.begin_step` with the step's micro-batches (the global
loss-token count, all-reduced before any backward), then, per micro-batch, the loss to
backpropagate and the summed loss to log. A new objective is another class with the same
two calls.

The step minimises

    sum of per-token losses over every micro-batch of the step on every rank
    ---------------------------------------------------------------------
                total loss tokens of the step on every rank

by scaling each micro-batch's *summed* loss by ``world_size * accum / global_tokens``: the
engine divides by ``accum`` and averages gradients over ``world_size`` ranks, so the
gradient is exactly that of the token-weighted mean (see :mod:`mmtune.training.loop`).

:class:`VisionOnEveryRank` is why a text-only micro-batch does not hang a sharded engine.
An engine that shards the weights gathers the vision tower's from every rank in its
forward, so every rank must run it, and at the same point of the forward as a rank with
images: before the language model. A forward pre-hook on the language model's layer stack
runs the adapter's zero-valued dummy image there (``vision_dummy_loss``) when the
micro-batch has no image, for every family alike.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.models.base import ModelAdapter

__all__ = ["TokenWeightedCrossEntropy", "VisionOnEveryRank", "layer_stack"]


def layer_stack(modules: list[nn.Module]) -> tuple[Optional[nn.Module], list[nn.Module]]:
    """The layer stack under ``modules``: the ``nn.ModuleList`` with the most parameter tensors
    (the decoder layers of a language model, the blocks of a vision tower), with the
    module that holds it; ``(None, [])`` when there is none.

    Found by structure, not by name, so it is the same for every family.
    """
    best: tuple[Optional[nn.Module], list[nn.Module]] = (None, [])
    best_size = 0
    for top in modules:
        for parent in top.modules():
            for child in parent.children():
                if isinstance(child, nn.ModuleList) and len(child) > 1:
                    # Counted in parameter tensors, not elements: an engine may have partitioned
                    # the weights already (ZeRO-3 at construction), leaving empty local tensors.
                    size = sum(1 for _ in child.parameters())
                    if size > best_size:
                        best, best_size = (parent, list(child)), size
    return best


class VisionOnEveryRank:
    """Runs the vision tower on a zero-weighted dummy image inside the forward of a text-only micro-batch.

    Example::

        vision = VisionOnEveryRank(adapter, model, groups)
        with vision.armed(text_only=True):
            loss = objective_forward(...)
        loss = loss + vision.take()          # exactly 0; gives vision parameters zero gradients
    """

    def __init__(self, adapter: "ModelAdapter", model: nn.Module, language_model: list[nn.Module]):
        self.adapter, self.model = adapter, model
        body, _ = layer_stack(language_model)
        if body is None:
            raise ValueError(f"cannot find the language model's layer stack in {type(model).__name__}: the "
                             f"{adapter.family} adapter's module_groups().language_model holds no nn.ModuleList "
                             "of layers")
        self._handle = body.register_forward_pre_hook(self._run)
        self._armed = False
        self._value: Optional[torch.Tensor] = None

    def _run(self, _module: nn.Module, _args: Any) -> None:
        if self._armed and self._value is None:  # once per forward, before the first layer
            self._value = self.adapter.vision_dummy_loss(self.model)

    @contextlib.contextmanager
    def armed(self, text_only: bool) -> Iterator[None]:
        """While the block runs the model's forward, run the dummy image if ``text_only``."""
        self._armed, self._value = text_only, None
        try:
            yield
        finally:
            self._armed = False

    def take(self) -> torch.Tensor | float:
        """The dummy's zero-valued output of the last armed forward (0.0 when none ran)."""
        value, self._value = self._value, None
        return value if value is not None else 0.0

    def remove(self) -> None:
        self._handle.remove()


class TokenWeightedCrossEntropy:
    """The summed next-token cross-entropy, weighted by loss tokens across micro-batches and ranks.

    Args:
        loss: ``loss(batch) -> summed fp32 loss`` of one micro-batch (the loop's
            ``batch_loss``: the model's forward and :class:`~mmtune.training.loss.TrainingLoss`).
        reduce_sum: all-reduces a tensor by sum over ranks (``accelerator.reduce``).
        world_size, accumulation: ranks and micro-batches per optimizer step.
        device: where the token count is reduced.
        row_replicas: ranks that hold each micro-batch (the sequence-parallel size: each
            computes its shard's loss), so each row's loss tokens are counted once.
    """

    def __init__(self, loss: Callable[..., torch.Tensor], *, reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 world_size: int, accumulation: int, device: torch.device, row_replicas: int = 1):
        self.loss, self.reduce_sum = loss, reduce_sum
        self.row_replicas = row_replicas
        self.world_size, self.accumulation, self.device = world_size, accumulation, device
        self.global_tokens = 0
        self.scale = 1.0

    @property
    def description(self) -> str:
        return "token-weighted cross-entropy (sum over loss tokens / global loss tokens of the step)"

    def begin_step(self, micro_batches: list[dict[str, Any]]) -> int:
        """Count the step's loss tokens on every rank (a collective, before any backward); returns the count."""
        local = sum(int(batch["num_loss_tokens"].sum()) for batch in micro_batches)
        self.global_tokens = int(self.reduce_sum(torch.tensor(local, device=self.device)).item()) // self.row_replicas
        self.scale = self.world_size * self.accumulation / max(self.global_tokens, 1)
        return self.global_tokens

    def __call__(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss to backpropagate, summed loss)`` of one micro-batch of the current step."""
        summed = self.loss(batch)
        return summed * self.scale, summed

    def step_loss(self, summed_over_micro_batches: float) -> float:
        """The step's logged loss: the global sum over the global loss-token count."""
        return summed_over_micro_batches / max(self.global_tokens, 1)

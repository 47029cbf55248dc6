"""The training loss from final hidden states: summed next-token cross-entropy without full logits.

Computing ``lm_head(hidden).float()`` for every position costs ``tokens x vocab`` fp32
values, and autograd keeps that tensor, its log-softmax and their gradients alive: at
8k tokens that is 1 GB per copy for LLaVA's 32,064-entry vocabulary and 3 GB for
InternLM2's 92,544. A *linear cross-entropy* takes the hidden states and the output
projection instead and never holds more than one chunk of logits.

Three implementations, chosen by ``training.loss_impl``:

``chunked``
    Pure PyTorch (:class:`ChunkedLinearCrossEntropy`). The forward pass keeps only the
    loss rows' log-sum-exp; the backward pass recomputes each chunk's logits and writes
    that chunk's rows of the hidden-state gradient and adds into an fp32 output-weight
    gradient. Rows whose label is ignored never reach the matmul (prompt, image and
    padding tokens are most of a multimodal dialogue). Works on every device, under
    autocast, with LoRA on the output head and under DeepSpeed ZeRO-3.
``fused``
    Liger's fused linear cross-entropy (the optional ``liger`` extra; CUDA only). It
    computes the gradients during the forward pass, so nothing is recomputed.
``materialized``
    The plain ``F.cross_entropy`` on full logits: the reference the other two are tested
    against, and the fallback when the output head cannot be read as one matrix.

``auto`` resolves to ``fused`` when Liger is installed and the model is on CUDA,
otherwise to ``chunked``.

Every implementation returns the same quantity: the *sum* over non-ignored positions of
the next-token loss, computed in fp32 (the training loop scales it into the
token-weighted mean; see :mod:`mmtune.training.loop`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mmtune.models.base import IGNORE_INDEX
from mmtune.training.config import LOSS_IMPLS

__all__ = [
    "LOSS_IMPLS",
    "ChunkedLinearCrossEntropy",
    "OutputHead",
    "TrainingLoss",
    "chunked_linear_cross_entropy",
    "describe",
    "fused_available",
    "gathered",
    "linear_cross_entropy_sum",
    "materialized_cross_entropy_sum",
    "output_head",
    "resolve_loss_impl",
    "shifted_targets",
]

DEFAULT_CHUNK_SIZE = 1024

log = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------------
# Choosing an implementation
# -------------------------------------------------------------------------------------------------


def fused_available() -> bool:
    """Whether Liger's fused linear cross-entropy can be imported (it needs Triton and CUDA)."""
    return importlib.util.find_spec("liger_kernel") is not None and torch.cuda.is_available()


def resolve_loss_impl(impl: str, device: torch.device | str) -> str:
    """The implementation ``impl`` means on ``device``.

    Raises:
        ValueError: ``impl`` is not one of :data:`LOSS_IMPLS`, or ``fused`` was asked for
            where Liger or CUDA is missing (says how to fix it).
    """
    if impl not in LOSS_IMPLS:
        raise ValueError(f"training.loss_impl={impl!r}: use one of {', '.join(LOSS_IMPLS)}")
    on_cuda = torch.device(device).type == "cuda"
    if impl == "auto":
        return "fused" if on_cuda and fused_available() else "chunked"
    if impl == "fused" and not (on_cuda and fused_available()):
        missing = "CUDA" if not on_cuda else "liger-kernel (`pip install 'mmtune[liger]'`)"
        raise ValueError(f"training.loss_impl=fused needs {missing}; use training.loss_impl=chunked or auto")
    return impl


# -------------------------------------------------------------------------------------------------
# The output head as (weight, bias), under LoRA and ZeRO-3
# -------------------------------------------------------------------------------------------------


@dataclass
class OutputHead:
    """The output projection read as ``logits = hidden @ weight.T + bias``.

    ``params`` are the module's parameters that ``weight``/``bias`` are built from; under
    DeepSpeed ZeRO-3 they are gathered around every use (see :func:`gathered`).
    ``build`` returns ``(weight, bias)`` from those parameters inside autograd, so LoRA
    factors get their gradients through the matmul that forms the effective weight.
    """

    module: nn.Module
    params: list[nn.Parameter]
    kind: str  # "linear" or "lora"

    def build(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.kind == "linear":
            return self.module.weight, self.module.bias
        base = self.module.get_base_layer()
        name = self.module.active_adapters[0]
        a, b = self.module.lora_A[name].weight, self.module.lora_B[name].weight
        # W + s * B @ A: with no dropout this is exactly what the LoRA forward computes row by row.
        weight = base.weight + self.module.scaling[name] * (b @ a).to(base.weight.dtype)
        return weight, base.bias


def output_head(module: nn.Module) -> tuple[Optional[OutputHead], str]:
    """Read ``module`` (a model's output embeddings) as one matrix, or say why it cannot be.

    Returns:
        ``(head, "")`` for an ``nn.Linear`` or a peft LoRA ``Linear`` with one active
        adapter, no dropout and nothing merged; ``(None, reason)`` otherwise, and the
        caller falls back to materialised logits.
    """
    if type(module) is nn.Linear:
        return OutputHead(module, [p for p in (module.weight, module.bias) if p is not None], "linear"), ""
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a core dependency
        LoraLinear = ()
    if LoraLinear and isinstance(module, LoraLinear):
        base = module.get_base_layer()
        active = list(module.active_adapters)
        problems = []
        if type(base) is not nn.Linear:
            problems.append(f"its base layer is a {type(base).__name__}, not nn.Linear")
        if len(active) != 1:
            problems.append(f"{len(active)} active adapters (one is supported)")
        elif not isinstance(module.lora_dropout[active[0]], nn.Identity):
            problems.append("LoRA dropout on the output head (set peft.dropout=0 or leave lm_head out of "
                            "peft.target_modules)")
        elif getattr(module, "use_dora", {}).get(active[0], False):
            problems.append("DoRA on the output head")
        if module.merged:
            problems.append("merged adapter weights")
        if any(hasattr(p, "ds_id") for p in module.parameters()):
            # ZeRO-3 hooks gather only a module's own parameters; a LoRA layer has none of its own,
            # so the factors saved for the effective weight's backward would be empty shards.
            problems.append("DeepSpeed ZeRO-3 parameters")
        if problems:
            return None, "LoRA output head with " + "; ".join(problems)
        name = active[0]
        params = [p for p in (base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight)
                  if p is not None]
        return OutputHead(module, params, "lora"), ""
    return None, f"output head is a {type(module).__name__}, not an nn.Linear or a LoRA Linear"


def _zero3_partitioned(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters DeepSpeed ZeRO-3 holds partitioned right now (empty on this rank)."""
    partitioned = []
    for p in params:
        status = getattr(p, "ds_status", None)
        if status is not None and getattr(status, "name", "") == "NOT_AVAILABLE":
            partitioned.append(p)
    return partitioned


@contextlib.contextmanager
def gathered(params: list[nn.Parameter]) -> Iterator[None]:
    """Make ZeRO-3-partitioned ``params`` whole for the duration of the block (no-op otherwise).

    The linear cross-entropy reads the output weight without calling the head module,
    so DeepSpeed's module hooks never gather it: the loss gathers it itself, in the
    forward pass and again in the backward pass (a custom autograd function's backward
    runs outside every module hook).
    """
    partitioned = _zero3_partitioned(params)
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield


# -------------------------------------------------------------------------------------------------
# The chunked implementation
# -------------------------------------------------------------------------------------------------


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would use for ``lm_head`` here (or the hidden states' own)."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden[i] @ weight.T + bias, target[i])`` over rows with a target, chunk by chunk.

    Forward saves the hidden states (already alive for the backward of the layer that
    made them), the row indices with a target and one fp32 log-sum-exp per such row.
    Backward recomputes one chunk of logits at a time, turns it into ``softmax - onehot``
    in fp32 and multiplies back: hidden-state rows are written once (rows never span two
    chunks), weight and bias gradients are accumulated in fp32.

    ``head`` (an :class:`OutputHead` or ``None``) is only used to gather ZeRO-3
    parameters again in backward; the gradients flow to ``weight``/``bias`` as given.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                chunk_size: int, compute_dtype: torch.dtype, head: Optional[OutputHead]) -> torch.Tensor:
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        acc = _accum_dtype(compute_dtype)
        lse = torch.empty(rows.numel(), dtype=acc, device=hidden.device)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, rows.numel(), chunk_size):
                idx = rows[start:start + chunk_size]
                logits = _chunk_logits(hidden, idx, w, b, compute_dtype)
                picked = logits.gather(1, targets[idx].unsqueeze(1)).squeeze(1)
                # log-sum-exp in place: torch.logsumexp would allocate a second chunk of logits.
                top = logits.amax(dim=1)
                chunk_lse = logits.sub_(top.unsqueeze(1)).exp_().sum(dim=1).log_().add_(top)
                lse[start:start + chunk_size] = chunk_lse
                total += (chunk_lse - picked).sum()
                del logits
        ctx.save_for_backward(hidden, targets, rows, lse)
        ctx.chunk_size, ctx.compute_dtype, ctx.head = chunk_size, compute_dtype, head
        ctx.weight, ctx.bias = weight, bias  # re-read in backward: ZeRO-3 swaps .data back to a shard
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, targets, rows, lse = ctx.saved_tensors
        weight, bias, dtype = ctx.weight, ctx.bias, ctx.compute_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        context = gathered(ctx.head.params) if ctx.head is not None else contextlib.nullcontext()
        with context, torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            b = bias.to(dtype) if bias is not None else None
            grad_h = torch.zeros_like(hidden) if need_h else None
            acc = _accum_dtype(dtype)
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
            grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
            scale = grad_total.to(acc)
            for start in range(0, rows.numel(), ctx.chunk_size):
                idx = rows[start:start + ctx.chunk_size]
                logits = _chunk_logits(hidden, idx, w, b, dtype)
                # d(lse - logit[target]) / d logits = softmax - onehot, all in place on the chunk.
                grad_logits = logits.sub_(lse[start:start + ctx.chunk_size].unsqueeze(1)).exp_()
                grad_logits.scatter_add_(1, targets[idx].unsqueeze(1),
                                         torch.full((idx.numel(), 1), -1.0, dtype=acc, device=logits.device))
                grad_logits.mul_(scale)
                if grad_b is not None:
                    grad_b += grad_logits.sum(0)
                grad_logits = grad_logits.to(dtype)
                if grad_h is not None:
                    grad_h[idx] = (grad_logits @ w).to(grad_h.dtype)
                if grad_w is not None:
                    h = hidden[idx].to(dtype)
                    if grad_w.dtype == dtype:
                        grad_w.addmm_(grad_logits.t(), h)  # in place: no second [V, H] tensor
                    else:
                        grad_w += grad_logits.t() @ h  # 16-bit product, fp32 accumulation across chunks
                del grad_logits, logits
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _chunk_logits(hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of ``hidden[idx]`` (the matmul in ``dtype``, as autocast would run it)."""
    h = hidden[idx].to(dtype)
    logits = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    return logits.to(_accum_dtype(dtype))


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 matmuls; fp64 stays fp64 (gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                 bias: Optional[torch.Tensor] = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                                 head: Optional[OutputHead] = None) -> torch.Tensor:
    """Summed cross-entropy of ``hidden [N, H] @ weight.T [H, V] (+ bias)`` against ``targets [N]``.

    ``IGNORE_INDEX`` targets contribute nothing. Under autocast the matmuls run in the
    autocast dtype (as ``lm_head`` would) and everything after them in fp32.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}] to match the hidden size; got {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, _compute_dtype(hidden), head)


# -------------------------------------------------------------------------------------------------
# The loss the training loop calls
# -------------------------------------------------------------------------------------------------


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the hidden states: position t predicts label t+1, the last predicts nothing.

    Shifting the labels (not the hidden states) keeps ``hidden.reshape(-1, H)`` a view.
    """
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[..., :-1] = labels[..., 1:]
    return targets


def materialized_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropies from full ``logits [B, L, V]`` (fp32), labels aligned with inputs."""
    shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy_sum(hidden: torch.Tensor, head_module: nn.Module, labels: torch.Tensor, *,
                             impl: str = "chunked", chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Summed next-token cross-entropy of ``head_module(hidden)`` against ``labels``, in fp32.

    Args:
        hidden: final hidden states ``[B, L, H]`` (after the last norm).
        head_module: the model's output embeddings (``lm_head`` / ``output``), possibly a
            LoRA layer; must be readable by :func:`output_head` unless ``impl`` is
            ``materialized``.
        labels: ``[B, L]`` aligned with the input ids (the collator's convention).
        impl: a resolved implementation: ``chunked``, ``fused`` or ``materialized``.
        chunk_size: loss rows per chunk (``chunked`` only).
    """
    if impl == "materialized":
        return materialized_cross_entropy_sum(head_module(hidden), labels)
    head, reason = output_head(head_module)
    if head is None:
        raise ValueError(f"training.loss_impl={impl} cannot read the output head: {reason}")
    if impl not in ("chunked", "fused"):
        raise ValueError(f"unknown loss implementation {impl!r}; use one of {', '.join(LOSS_IMPLS[1:])}")
    targets = shifted_targets(labels.to(hidden.device)).reshape(-1)

    def loss_of(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.size(-1))
        with gathered(head.params):
            weight, bias = head.build()
            if impl == "chunked":
                return chunked_linear_cross_entropy(flat, weight, targets, bias=bias, chunk_size=chunk_size, head=head)
            return _liger_sum(flat, weight, bias, targets)

    return _call_as_forward(head.module, loss_of, hidden)


def _call_as_forward(module: nn.Module, fn, *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)`` run as ``module``'s forward, so the hooks on ``module`` bracket it.

    DeepSpeed ZeRO-3 gathers a module's parameters in hooks around its forward *and* its
    backward, and autograd accumulates a parameter's gradient right after the node that
    produced it, while the parameter is still gathered. A custom autograd function that
    reads ``lm_head.weight`` outside those hooks returns a full-size gradient for a
    parameter that is an empty shard by then, and accumulating it fails. Called through
    the module, the loss's backward runs inside the module's backward hooks like
    ``nn.Linear``'s would. Without hooks (DDP, one device) this is a plain call.
    """
    module.forward = fn  # an instance attribute shadows the class's forward for this call only
    try:
        return module(*args)
    finally:
        del module.forward


def _liger_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               targets: torch.Tensor) -> torch.Tensor:
    """Liger's fused kernel with our conventions: autocast dtype matmuls, fp32 accumulation, sum."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    dtype = _compute_dtype(hidden)
    extra = {}
    if "accum_dtype" in inspect.signature(liger_fused_linear_cross_entropy).parameters:
        extra["accum_dtype"] = torch.float32  # fp32 weight-gradient accumulation (newer Liger releases)
    with torch.autocast(hidden.device.type, enabled=False):
        loss = liger_fused_linear_cross_entropy(
            hidden.to(dtype).contiguous(), weight.to(dtype), targets, bias=None if bias is None else bias.to(dtype),
            ignore_index=IGNORE_INDEX, reduction="sum", **extra)
    return loss.float()


def describe(impl: str, chunk_size: int) -> str:
    """The start-up line's words for a resolved implementation."""
    return {
        "chunked": f"chunked linear cross-entropy ({chunk_size} rows per chunk, no full logits)",
        "fused": "fused linear cross-entropy (Liger kernel, no full logits)",
        "materialized": "materialised logits + cross-entropy",
    }[impl]



# -------------------------------------------------------------------------------------------------
# Model forward + loss for the training loop
# -------------------------------------------------------------------------------------------------


class TrainingLoss:
    """Runs a (wrapped) model on a batch and returns the summed next-token loss.

    For ``chunked`` and ``fused`` the model still runs through its own (DDP / DeepSpeed /
    peft) forward, so every wrapper hook fires as usual, but with ``logits_to_keep=1``:
    the output head sees one position per row. The final hidden states are taken from
    the adapter's *body* module (``adapter.loss_modules``) by a forward hook, and the
    loss reads the output head's weight directly.

    When the model cannot take that path (an adapter without ``loss_modules``, an output
    head that is not one matrix) the loss falls back to materialised logits and
    ``reason`` says why; the start-up line prints it.

    Example::

        loss = TrainingLoss(adapter, model, impl="auto", chunk_size=1024, device=device)
        print(loss.description)
        summed = loss(model, inputs, labels)   # fp32 scalar, sum over loss tokens
    """

    def __init__(self, adapter, model: nn.Module, *, impl: str = "auto", chunk_size: int = DEFAULT_CHUNK_SIZE,
                 device: torch.device | str = "cpu"):
        self.adapter = adapter
        self.chunk_size = chunk_size
        self.requested = impl
        self.impl = resolve_loss_impl(impl, device)
        self.reason = ""
        self._captured: list[torch.Tensor] = []
        self._tap, self._tapped, self._armed = None, None, False
        if self.impl != "materialized":
            try:
                _, head_module = adapter.loss_modules(getattr(model, "_orig_mod", model))
            except NotImplementedError as err:
                head, self.reason = None, str(err)
            else:
                head, self.reason = output_head(head_module)
            if head is None:
                log.warning("training.loss_impl=%s falls back to materialised logits: %s", impl, self.reason)
                self.impl = "materialized"

    @property
    def description(self) -> str:
        text = describe(self.impl, self.chunk_size)
        return f"{text} (fallback: {self.reason})" if self.reason else text

    def __call__(self, model: nn.Module, inputs: dict, labels: torch.Tensor) -> torch.Tensor:
        if self.impl == "materialized":
            logits = model(**inputs, use_cache=False).logits
            return materialized_cross_entropy_sum(logits, labels)
        # A torch.compile'd model keeps the real module tree under _orig_mod.
        body, head_module = self.adapter.loss_modules(getattr(model, "_orig_mod", model))
        if self._tapped is not body:
            # One persistent hook (not one per step): compiled graphs guard on a module's hooks.
            if self._tap is not None:
                self._tap.remove()
            self._tap, self._tapped = body.register_forward_hook(self._keep), body
        self._captured.clear()
        self._armed = True  # the hook stays registered but keeps nothing outside this call (evaluation)
        try:
            # logits_to_keep=1: the head runs on one position per row (wrappers still see a normal forward).
            model(**inputs, use_cache=False, logits_to_keep=1)
        finally:
            self._armed = False
        if len(self._captured) != 1:
            raise RuntimeError(f"expected one call of {type(body).__name__} per forward, saw {len(self._captured)}")
        hidden = self._captured.pop()
        return linear_cross_entropy_sum(hidden, head_module, labels.to(hidden.device),
                                        impl=self.impl, chunk_size=self.chunk_size)

    def _keep(self, _module: nn.Module, _args: tuple, output) -> None:
        if self._armed:
            self._captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

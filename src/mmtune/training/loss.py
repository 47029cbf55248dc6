"""The training loss from final hidden states: summed next-token cross-entropy without full logits.

Computing ``lm_head(hidden).float()`` for every position costs ``tokens x vocab`` fp32
values, and autograd keeps that tensor, its log-softmax and their gradients alive: at
8k tokens that is 1 GB per copy for LLaVA's 32,064-entry vocabulary and 3 GB for
InternLM2's 92,544. A *linear cross-entropy* takes the hidden states and the output
projection instead and never holds more than one chunk of logits.

Three implementations, chosen by ``training.loss_impl``:

``chunked``
    Pure PyTorch (:class:`ChunkedLinearCrossEntropy`). Like a fused linear
    cross-entropy kernel (Liger's ``fused_linear_cross_entropy``), the forward pass
    computes each chunk's logits, turns them into ``softmax - onehot`` in place and
    multiplies back at once: the chunk's rows of the hidden-state gradient and its share
    of an fp32 output-weight gradient. Three matmuls per chunk, none recomputed; the
    backward pass only scales the stored gradients by the upstream gradient. Rows whose
    label is ignored never reach a matmul (prompt, image and padding tokens are most of
    a multimodal dialogue), and with gradients disabled (evaluation) only the logits
    matmul runs. Works on every device, under autocast, with LoRA on the output head and
    under engines that shard the head (they gather it). On CPU in fp32 the products run on oneDNN's kernel where
    PyTorch has it (:class:`_OneDnnMatmuls`: about twice torch's matmul on AMD processors).
``fused``
    Liger's fused linear cross-entropy (the optional ``liger`` extra; CUDA only), the
    same algorithm as Triton kernels.
``materialized``
    The plain ``F.cross_entropy`` on full logits: the reference the other two are tested
    against, and the fallback when the output head cannot be read as one matrix.

``auto`` resolves to ``fused`` when Liger is installed and the model is on CUDA,
otherwise to ``chunked``. :func:`choose_loss_impl` is that resolution, with the
fallbacks; the training loop (:class:`TrainingLoss`) and ``mmtune plan``
(:func:`planned_loss_impl`) both go through it.

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
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mmtune.models.base import IGNORE_INDEX
from mmtune.training.config import LOSS_IMPLS

__all__ = [
    "LOSS_IMPLS",
    "ChunkedLinearCrossEntropy",
    "LossChoice",
    "OutputHead",
    "TrainingLoss",
    "choose_loss_impl",
    "chunked_linear_cross_entropy",
    "describe",
    "fused_available",
    "joined_with_outputs",
    "liger_installed",
    "linear_cross_entropy_sum",
    "materialized_cross_entropy_sum",
    "model_head_problem",
    "output_head",
    "planned_loss_impl",
    "shifted_targets",
]

DEFAULT_CHUNK_SIZE = 1024

log = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------------
# Choosing an implementation
# -------------------------------------------------------------------------------------------------


def liger_installed() -> bool:
    """Whether Liger (``liger-kernel``, the optional ``liger`` extra) is installed."""
    return importlib.util.find_spec("liger_kernel") is not None


def fused_available() -> bool:
    """Whether Liger's fused linear cross-entropy can run here (it needs Triton and CUDA)."""
    return liger_installed() and torch.cuda.is_available()


@dataclass(frozen=True)
class LossChoice:
    """A resolved ``training.loss_impl``.

    ``impl`` is ``chunked``, ``fused`` or ``materialized``; ``reason`` is empty unless a
    linear cross-entropy was asked for (or ``auto``) and the output head forced the
    materialised fallback, and then says why.
    """

    impl: str
    reason: str = ""


def choose_loss_impl(requested: str, *, device_type: str, head_problem: str = "",
                     liger: Optional[bool] = None) -> LossChoice:
    """What ``training.loss_impl=requested`` runs as, on ``device_type``, for a head with ``head_problem``.

    The one resolution of the setting: the training loop calls it with the model's
    device and the problem :func:`model_head_problem` finds on the live model;
    ``mmtune plan`` with ``"cuda"`` and the problem :func:`planned_loss_impl` predicts
    from the config.

    Args:
        requested: one of :data:`LOSS_IMPLS`.
        device_type: where the loss runs (``"cuda"``, ``"cpu"``, ...).
        head_problem: why the output head cannot be read as one matrix (see
            :func:`output_head`), empty when it can; a non-empty problem turns
            ``chunked``/``fused``/``auto`` into ``materialized`` with it as the reason.
        liger: whether Liger is installed (default: look it up).

    Raises:
        ValueError: ``requested`` is not one of :data:`LOSS_IMPLS`, or ``fused`` was asked
            for where Liger or CUDA is missing (says how to fix it).
    """
    if requested not in LOSS_IMPLS:
        raise ValueError(f"training.loss_impl={requested!r}: use one of {', '.join(LOSS_IMPLS)}")
    liger = liger_installed() if liger is None else liger
    on_cuda = device_type == "cuda"
    impl = requested
    if requested == "auto":
        impl = "fused" if on_cuda and liger else "chunked"
    elif requested == "fused" and not (on_cuda and liger):
        missing = "CUDA" if not on_cuda else "liger-kernel (`pip install 'mmtune[liger]'`)"
        raise ValueError(f"training.loss_impl=fused needs {missing}; use training.loss_impl=chunked or auto")
    if impl != "materialized" and head_problem:
        return LossChoice("materialized", head_problem)
    return LossChoice(impl)


def model_head_problem(adapter, model: nn.Module, engine=None) -> str:
    """Why the linear cross-entropy cannot read ``model``'s output head ("" when it can).

    Asks the adapter for the body and head (:meth:`~mmtune.models.base.ModelAdapter.loss_modules`)
    and reads the head with :func:`output_head`; a torch.compile'd model is looked at
    through ``_orig_mod``.
    """
    try:
        _, head_module = adapter.loss_modules(getattr(model, "_orig_mod", model))
    except NotImplementedError as err:
        return str(err)
    if engine is None:
        return output_head(head_module)[1]
    return output_head(head_module, engine.head_problem(head_module), head_class=engine.original_class(head_module))[1]


def planned_loss_impl(cfg, model: nn.Module) -> LossChoice:
    """The loss a run of ``cfg`` (an :class:`~mmtune.training.config.SFTConfig`) trains with on CUDA GPUs.

    ``model`` is the run's model built on the meta device (no peft applied); the
    head's problems are predicted from the config the way the loop finds them on the
    live model: a family whose adapter names no body and head, a head that is not an
    ``nn.Linear``, LoRA on the output head (``peft.target_modules`` naming it) with
    dropout, or under an engine that cannot gather it (the engine class says,
    :meth:`~mmtune.training.engines.base.Engine.planned_head_problem`). Liger counts as
    available when it is installed here.

    Raises:
        ValueError: as :func:`choose_loss_impl` (``fused`` without Liger installed).
    """
    from mmtune.models.base import ModelAdapter
    from mmtune.models.registry import adapter_class
    from mmtune.training.engines import engine_class

    adapter_cls = adapter_class(cfg.model.family)
    problem = ""
    head = model.get_output_embeddings()
    if adapter_cls.loss_modules is ModelAdapter.loss_modules:
        problem = f"the {cfg.model.family} adapter does not name its hidden-state body and output head"
    elif head is None:
        problem = f"{type(model).__name__} has no output embeddings"
    else:
        problem = output_head(head)[1]  # the head as built, before peft
        targets = set(cfg.peft.target_modules or adapter_cls.default_lora_targets)
        name = next(n for n, m in model.named_modules() if m is head)
        # peft wraps the linear layers whose last name is a target (see peft_setup.lora_target_names)
        if not problem and cfg.peft.method in ("lora", "qlora") and name.rsplit(".", 1)[-1] in targets:
            backend = cfg.training.backend
            engine = engine_class(backend.engine).planned_head_problem(getattr(backend, backend.engine),
                                                                       lora_head=True)
            problems = _lora_head_problems(adapters=1, dropout=cfg.peft.dropout > 0, dora=False, merged=False,
                                           engine=engine)
            problem = "LoRA output head with " + "; ".join(problems) if problems else ""
    return choose_loss_impl(cfg.training.loss_impl, device_type="cuda", head_problem=problem)


# -------------------------------------------------------------------------------------------------
# The output head as (weight, bias), under LoRA and sharding engines
# -------------------------------------------------------------------------------------------------


@dataclass
class OutputHead:
    """The output projection read as ``logits = hidden @ weight.T + bias``.

    ``params`` are the module's parameters that ``weight``/``bias`` are built from; an engine
    that shards them gathers them around every use (``Engine.gathered``).
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


def output_head(module: nn.Module, engine_problem: str = "",
                head_class: Optional[type] = None) -> tuple[Optional[OutputHead], str]:
    """Read ``module`` (a model's output embeddings) as one matrix, or say why it cannot be.

    ``engine_problem`` is why the run's engine cannot gather a LoRA head's factors
    (``Engine.head_problem``), empty when it can. ``head_class`` is the class the module
    was built with where the engine gave it another (``Engine.original_class``: a sharding
    unit's class derives from the module's own); default ``type(module)``.

    Returns:
        ``(head, "")`` for an ``nn.Linear`` or a peft LoRA ``Linear`` with one active
        adapter, no dropout and nothing merged; ``(None, reason)`` otherwise, and the
        caller falls back to materialised logits.
    """
    # Exactly nn.Linear: a subclass (a quantized linear layer) may not compute hidden @ weight.T.
    if (head_class or type(module)) is nn.Linear:
        if engine_problem:
            return None, engine_problem
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
        problems += _lora_head_problems(
            adapters=len(active),
            dropout=len(active) == 1 and not isinstance(module.lora_dropout[active[0]], nn.Identity),
            dora=len(active) == 1 and getattr(module, "use_dora", {}).get(active[0], False),
            merged=bool(module.merged), engine=engine_problem)
        if problems:
            return None, "LoRA output head with " + "; ".join(problems)
        name = active[0]
        params = [p for p in (base.weight, base.bias, module.lora_A[name].weight, module.lora_B[name].weight)
                  if p is not None]
        return OutputHead(module, params, "lora"), ""
    return None, f"output head is a {type(module).__name__}, not an nn.Linear or a LoRA Linear"


def _lora_head_problems(*, adapters: int, dropout: bool, dora: bool, merged: bool, engine: str) -> list[str]:
    """Why a LoRA output head cannot be read as ``W + s * B @ A`` (empty when it can).

    Shared by :func:`output_head` (facts read from the live module) and
    :func:`planned_loss_impl` (facts from the config).
    """
    problems = []
    if adapters != 1:
        problems.append(f"{adapters} active adapters (one is supported)")
    elif dropout:
        problems.append("LoRA dropout on the output head (set peft.dropout=0 or leave lm_head out of "
                        "peft.target_modules)")
    elif dora:
        problems.append("DoRA on the output head")
    if merged:
        problems.append("merged adapter weights")
    if engine:
        problems.append(engine)
    return problems


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

    The loss is the last operation of the forward pass, so its gradients can be computed
    there (as fused linear cross-entropy kernels do): per chunk, one matmul forms the
    logits, the fp32 block becomes ``softmax - onehot`` in place, and two more matmuls
    write the chunk's rows of the hidden-state gradient and add into an fp32
    output-weight gradient. Only those gradients are saved; the backward pass scales
    them by the upstream gradient (in place) and hands them on, so nothing is
    recomputed and neither the hidden states nor the weight are kept for it (a backward
    that keeps the graph, for a second one, gets scaled copies instead).

    What is computed follows what needs it: no weight-gradient matmul for a frozen head,
    no hidden-gradient matmul for hidden states that need no gradient, and nothing but
    the logits when ``grad_enabled`` is false (evaluation, or the first pass of a
    reentrant activation checkpoint). Under a non-reentrant checkpoint the forward runs
    again in backward; the gradients are saved with ``save_for_backward``, so the
    checkpoint drops the first pass's and uses the recomputed ones.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                chunk_size: int, compute_dtype: torch.dtype, grad_enabled: bool) -> torch.Tensor:
        # needs_input_grad says which inputs require grad, even under no_grad: the caller says whether grad is on.
        need_h, need_w, need_b = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
        acc = _accum_dtype(compute_dtype)
        device = hidden.device
        total = torch.zeros((), dtype=acc, device=device)
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=device) if need_b else None
        with torch.autocast(device.type, enabled=False):
            w = weight.to(compute_dtype)
            b = bias.to(compute_dtype) if bias is not None else None
            matmuls = _chunk_matmuls(min(chunk_size, rows.numel()), weight.shape, compute_dtype, acc, device)
            for start in range(0, rows.numel(), chunk_size):
                idx = rows[start:start + chunk_size]
                h = hidden.index_select(0, idx).to(compute_dtype)
                logits = matmuls.logits(h, w, b)
                target = targets[idx].unsqueeze(1)
                picked = logits.gather(1, target).squeeze(1)
                # log-sum-exp in place: torch.logsumexp would allocate a second block of logits.
                top = logits.amax(dim=1, keepdim=True)
                sums = logits.sub_(top).exp_().sum(dim=1, keepdim=True)
                total += (sums.log().add_(top).squeeze(1) - picked).sum()
                if not (need_h or need_w or need_b):
                    continue
                # d(lse - logit[target]) / d logits = softmax - onehot, in place on the block.
                grad_logits = logits.div_(sums)
                grad_logits.scatter_add_(1, target, torch.full_like(picked, -1.0).unsqueeze(1))
                if grad_b is not None:
                    grad_b += grad_logits.sum(0)
                grad_logits = matmuls.low(grad_logits)  # the matmuls run in the compute dtype
                if grad_h is not None:
                    grad_h.index_copy_(0, idx, matmuls.grad_hidden(grad_logits, w).to(grad_h.dtype))
                if grad_w is not None:
                    matmuls.add_grad_weight(grad_w, grad_logits, h)
                del grad_logits, logits
            del matmuls
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total: torch.Tensor):
        # In place unless the graph is kept for another backward (retain_graph, gradcheck):
        # a copy of the fp32 weight gradient would be the largest tensor the loss holds.
        in_place = not _graph_is_kept()
        grads = []
        for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes):
            if grad is not None:
                # grad_total is a 0-dim fp32 tensor: the product is taken in fp32 even for a 16-bit grad.
                grad = grad.mul_(grad_total) if in_place else grad * grad_total
                grad = grad if grad.dtype == dtype else grad.to(dtype)
            grads.append(grad)
        return (*grads, None, None, None, None)


def _graph_is_kept() -> bool:
    """Whether the running backward keeps the graph (another backward may read the saved tensors).

    torch.compile's AOT-autograd runtime asks the same private function whether the graph
    is retained; if it ever disappears, the answer "kept" is the safe one.
    """
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else bool(kept())


def _chunk_matmuls(rows: int, weight_shape: torch.Size, compute_dtype: torch.dtype, acc: torch.dtype,
                   device: torch.device) -> "_TorchMatmuls | _OneDnnMatmuls":
    """oneDNN's kernels for fp32 on a CPU where PyTorch can run them, PyTorch's own matmul otherwise."""
    linear = _onednn_linear() if device.type == "cpu" and compute_dtype == torch.float32 else None
    if linear is not None:
        return _OneDnnMatmuls(linear, rows, weight_shape)
    return _TorchMatmuls(rows, weight_shape[0], compute_dtype, acc, device)


class _TorchMatmuls:
    """A chunk's three products by ``torch.mm``, in two blocks of logits allocated once for all chunks.

    ``rows x vocab`` in fp32 (logits, then their gradient) and, when the matmuls run in
    16 bit, the same in the compute dtype (the matmul's output, then the gradient's
    copy for the two gradient matmuls). Reusing them also spares the CPU a fresh
    page-faulted allocation per chunk.
    """

    def __init__(self, rows: int, vocab: int, compute_dtype: torch.dtype, acc: torch.dtype, device: torch.device):
        self.acc = torch.empty(rows, vocab, dtype=acc, device=device)
        self.compute = torch.empty(rows, vocab, dtype=compute_dtype, device=device) if compute_dtype != acc else None

    def logits(self, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        """fp32 logits of ``h`` (the matmul in the compute dtype, as autocast would run ``lm_head``)."""
        n = h.shape[0]
        out = self.acc[:n] if self.compute is None else self.compute[:n]
        if b is None:
            torch.mm(h, w.t(), out=out)
        else:
            torch.addmm(b, h, w.t(), out=out)
        return out if self.compute is None else self.acc[:n].copy_(out)

    def low(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` in the compute dtype (itself when that is the accumulation dtype)."""
        return block if self.compute is None else self.compute[:block.shape[0]].copy_(block)

    def grad_hidden(self, grad_logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return grad_logits @ w

    def add_grad_weight(self, grad_w: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
        if grad_w.dtype == grad_logits.dtype:
            grad_w.addmm_(grad_logits.t(), h)  # in place: no second [V, H] tensor
        else:
            grad_w += grad_logits.t() @ h  # 16-bit product, fp32 accumulation across chunks


class _OneDnnMatmuls:
    """A chunk's three products by oneDNN's fp32 linear kernel, on CPU.

    PyTorch runs an fp32 CPU matmul through MKL's sgemm, which on AMD processors takes
    its AVX2 code path; oneDNN (shipped inside PyTorch) dispatches on the processor's
    own features. Measured on a 2-core AMD EPYC with AVX-512: 410 against 185 GFLOP/s
    for a chunk's logits. The arithmetic is the same fp32 multiply-add, in another
    summation order. Every product is allocated by the kernel (it has no ``out=``), so
    the logits block is a fresh tensor per chunk instead of a reused one; the weight
    gradient is added in slices of the vocabulary, each product at most half a block.
    """

    def __init__(self, linear: Callable[..., torch.Tensor], rows: int, weight_shape: torch.Size):
        vocab, hidden = weight_shape
        self.linear = linear
        self.slice_rows = max(1, min(vocab, rows * vocab // (2 * hidden)))

    def logits(self, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        return self.linear(h, w, b)

    def low(self, block: torch.Tensor) -> torch.Tensor:
        return block

    def grad_hidden(self, grad_logits: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.linear(grad_logits, w.t())

    def add_grad_weight(self, grad_w: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
        h_t = h.t()
        for start in range(0, grad_w.shape[0], self.slice_rows):
            stop = start + self.slice_rows
            grad_w[start:stop] += self.linear(grad_logits[:, start:stop].t(), h_t)


def _onednn_linear() -> Optional[Callable[..., torch.Tensor]]:
    """``linear(x, w, b=None)``: ``x @ w.T (+ b)`` by PyTorch's oneDNN linear op
    (``torch.ops.mkldnn._linear_pointwise``, no fused activation), or None where it cannot run.

    None when PyTorch was built without oneDNN, when ``torch.backends.mkldnn.enabled`` is
    off (``with torch.backends.mkldnn.flags(enabled=False)``: the way to compare against
    ``torch.mm``) or when a build lacks the op.
    """
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None

    def linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
        return op(x, w, b, "none", [], "")

    return linear


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision and fp32 matmuls; fp64 stays fp64 (gradient checks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                                 bias: Optional[torch.Tensor] = None,
                                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Summed cross-entropy of ``hidden [N, H] @ weight.T [H, V] (+ bias)`` against ``targets [N]``.

    ``IGNORE_INDEX`` targets contribute nothing. Under autocast the matmuls run in the
    autocast dtype (as ``lm_head`` would) and everything after them in fp32. The
    gradients are computed in this call when grad mode is on and an input requires
    them (see :class:`ChunkedLinearCrossEntropy`).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}] to match the hidden size; got {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, _compute_dtype(hidden),
                                           torch.is_grad_enabled())


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


def materialized_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
    """Sum of next-token cross-entropies from full ``logits [B, L, V]`` (fp32), labels aligned with
    inputs (``shifted``: already the targets of each position, as a sequence-parallel shard's are)."""
    if shifted:
        flat = logits.reshape(-1, logits.size(-1)).float()
        return F.cross_entropy(flat, labels.reshape(-1).to(flat.device), ignore_index=IGNORE_INDEX, reduction="sum")
    shift_logits = logits[..., :-1, :].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def linear_cross_entropy_sum(hidden: torch.Tensor, head_module: nn.Module, labels: torch.Tensor, *,
                             impl: str = "chunked", chunk_size: int = DEFAULT_CHUNK_SIZE,
                             gathered: Optional[Callable[[list[nn.Parameter]], contextlib.AbstractContextManager]] = None,
                             engine_problem: str = "", head_class: Optional[type] = None,
                             shifted: bool = False) -> torch.Tensor:
    """Summed next-token cross-entropy of ``head_module(hidden)`` against ``labels``, in fp32.

    Args:
        hidden: final hidden states ``[B, L, H]`` (after the last norm).
        head_module: the model's output embeddings (``lm_head`` / ``output``), possibly a
            LoRA layer; must be readable by :func:`output_head` unless ``impl`` is
            ``materialized``.
        labels: ``[B, L]`` aligned with the input ids (the collator's convention).
        impl: a resolved implementation: ``chunked``, ``fused`` or ``materialized``.
        chunk_size: loss rows per chunk (``chunked`` only).
        gathered: the engine's ``gathered(params)``: makes sharded head parameters whole
            for the block (``Engine.gathered``); ``None`` when nothing is sharded.
        engine_problem: the engine's ``head_problem`` for this head (see :func:`output_head`).
        head_class: the class the head was built with, where the engine changed it
            (``Engine.original_class``; see :func:`output_head`).
        shifted: ``labels`` are already each position's target (a sequence-parallel shard's,
            shifted on the whole row before it was cut).
    """
    if impl == "materialized":
        return materialized_cross_entropy_sum(head_module(hidden), labels, shifted=shifted)
    head, reason = output_head(head_module, engine_problem, head_class)
    gather = gathered or (lambda params: contextlib.nullcontext())
    if head is None:
        raise ValueError(f"training.loss_impl={impl} cannot read the output head: {reason}")
    if impl not in ("chunked", "fused"):
        raise ValueError(f"unknown loss implementation {impl!r}; use one of {', '.join(LOSS_IMPLS[1:])}")
    labels = labels.to(hidden.device)
    targets = (labels if shifted else shifted_targets(labels)).reshape(-1)

    def loss_of(hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.size(-1))
        with gather(head.params):
            weight, bias = head.build()
            if impl == "chunked":
                return chunked_linear_cross_entropy(flat, weight, targets, bias=bias, chunk_size=chunk_size)
            return _liger_sum(flat, weight, bias, targets)

    return _call_as_forward(head.module, loss_of, hidden)


def _call_as_forward(module: nn.Module, fn, *args: torch.Tensor) -> torch.Tensor:
    """``fn(*args)`` run as ``module``'s forward, so the hooks on ``module`` bracket it.

    A sharding engine gathers a module's parameters in hooks
    around its forward *and* its backward, and autograd accumulates a parameter's gradient right after the node that
    produced it, while the parameter is still gathered. A custom autograd function that
    reads ``lm_head.weight`` outside those hooks returns a full-size gradient for a
    parameter that is an empty shard by then, and accumulating it fails. Called through
    the module, the loss's backward (which hands on the gradients the forward computed)
    runs inside the module's backward hooks like ``nn.Linear``'s would. Without hooks
    (DDP, one device) this is a plain call.
    """
    module.forward = fn  # an instance attribute shadows the class's forward for this call only
    try:
        return module(*args)
    finally:
        del module.forward


class _JoinOutputs(torch.autograd.Function):
    """``loss``, unchanged, with ``outputs`` as inputs of its node: backward hands ``loss`` its
    gradient and every output a zero one."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.outputs = [(o.shape, o.dtype, o.device) for o in outputs]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.outputs))


def joined_with_outputs(loss: torch.Tensor, output) -> torch.Tensor:
    """``loss`` (same value) whose backward also reaches the tensors of ``output`` that need a
    gradient (a model forward's output: a ``ModelOutput``, tuple or tensor), with zeros.

    An engine that starts a sharding unit's backward from hooks on that unit's forward
    outputs (FSDP2's root unit: the whole model) needs those hooks to run on every rank at
    the same point of the backward. Under the linear cross-entropy the outputs (logits of
    one position per row) are not part of the loss, so the hook would run only where some
    output is reached through the graph anyway (the image features a LLaVA-style model also
    returns, on a rank whose micro-batch has images), and there it starts the root unit's
    backward prefetch, an all-gather the other ranks never join. Joined here, the hook runs
    right after the loss on every rank, as it does from materialised logits.
    """
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else [output]
    tensors = []
    for value in values:
        for t in (value if isinstance(value, (tuple, list)) else [value]):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
    return _JoinOutputs.apply(loss, *tensors) if tensors else loss


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

    For ``chunked`` and ``fused`` the model still runs through its own (engine wrapper /
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
                 device: torch.device | str = "cpu", engine=None):
        self.adapter = adapter
        self.chunk_size = chunk_size
        self.requested = impl
        self.engine = engine  # gathers a sharded output head (None: nothing is sharded)
        choice = choose_loss_impl(impl, device_type=torch.device(device).type,
                                  head_problem=model_head_problem(adapter, model, engine))
        self.impl, self.reason = choice.impl, choice.reason
        if self.reason:
            log.warning("training.loss_impl=%s falls back to materialised logits: %s", impl, self.reason)
        self._captured: list[torch.Tensor] = []
        self._tap, self._tapped, self._armed = None, None, False

    @property
    def description(self) -> str:
        text = describe(self.impl, self.chunk_size)
        return f"{text} (fallback: {self.reason})" if self.reason else text

    def __call__(self, model: nn.Module, inputs: dict, labels: torch.Tensor, *, shifted: bool = False) -> torch.Tensor:
        """``shifted``: ``labels`` are the targets of each position (see :func:`linear_cross_entropy_sum`)."""
        if self.impl == "materialized":
            logits = model(**inputs, use_cache=False).logits
            return materialized_cross_entropy_sum(logits, labels, shifted=shifted)
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
            output = model(**inputs, use_cache=False, logits_to_keep=1)
        finally:
            self._armed = False
        if len(self._captured) != 1:
            raise RuntimeError(f"expected one call of {type(body).__name__} per forward, saw {len(self._captured)}")
        hidden = self._captured.pop()
        engine = self.engine
        loss = linear_cross_entropy_sum(hidden, head_module, labels.to(hidden.device), impl=self.impl,
                                        chunk_size=self.chunk_size, gathered=engine.gathered if engine else None,
                                        engine_problem=engine.head_problem(head_module) if engine else "",
                                        head_class=engine.original_class(head_module) if engine else None,
                                        shifted=shifted)
        if engine is not None and engine.loss_joins_model_outputs:
            loss = joined_with_outputs(loss, output)
        return loss

    def _keep(self, _module: nn.Module, _args: tuple, output) -> None:
        if self._armed:
            self._captured.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

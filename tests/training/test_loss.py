"""The linear cross-entropy equals the materialised loss: values and gradients, both families,
packed and padded batches, ignored positions, chunk boundaries inside a sample, LoRA, ZeRO-3;
its gradients come from the forward pass (three matmuls per chunk, none in backward); the loop
and ``mmtune plan`` resolve ``training.loss_impl`` the same way."""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from mmtune.data.dialogue import Image
from mmtune.models.base import IGNORE_INDEX
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from mmtune.training.config import LOSS_IMPLS, PeftConfig
from mmtune.training.loss import (
    LossChoice,
    TrainingLoss,
    _onednn_linear,
    choose_loss_impl,
    chunked_linear_cross_entropy,
    joined_with_outputs,
    linear_cross_entropy_sum,
    materialized_cross_entropy_sum,
    output_head,
    planned_loss_impl,
    shifted_targets,
)
from tests.support.processes import zero3_loss

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["llava", "internlm_xcomposer2"]


# -- the autograd function ----------------------------------------------------------------------


def _reference(hidden, weight, targets, bias=None):
    logits = hidden @ weight.t() + (0 if bias is None else bias)
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def test_gradcheck_in_float64_with_bias_and_ignored_rows():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (23,), generator=g)
    targets[::4] = IGNORE_INDEX
    assert torch.autograd.gradcheck(
        lambda h, w, b: chunked_linear_cross_entropy(h, w, targets, bias=b, chunk_size=5), (hidden, weight, bias))


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_loss_and_gradients_equal_materialized(chunk_size, with_bias, cpu_gemm):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(150, 32, generator=g, requires_grad=True)
    weight = (torch.randn(97, 32, generator=g) * 0.2).requires_grad_()
    bias = torch.randn(97, generator=g).requires_grad_() if with_bias else None
    targets = torch.randint(0, 97, (150,), generator=g)
    targets[torch.rand(150, generator=g) < 0.4] = IGNORE_INDEX
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    ours = chunked_linear_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=chunk_size)
    ours_grads = torch.autograd.grad(ours * 0.37, inputs)  # a non-unit upstream gradient (the loop's scale)
    ref = _reference(hidden, weight, targets, bias)
    ref_grads = torch.autograd.grad(ref * 0.37, inputs)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Ignored rows get exactly zero gradient.
    assert ours_grads[0][targets == IGNORE_INDEX].abs().max() == 0


def test_all_rows_ignored_gives_zero_loss_and_zero_gradients(cpu_gemm):
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(9, 4, requires_grad=True)
    loss = chunked_linear_cross_entropy(hidden, weight, torch.full((5,), IGNORE_INDEX), chunk_size=2)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_frozen_weight_gets_no_gradient_and_hidden_still_does(cpu_gemm):
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(20, 8)
    targets = torch.randint(0, 20, (12,))
    chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=5).backward()
    expected = torch.autograd.grad(_reference(hidden, weight, targets), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_is_as_accurate_as_the_materialized_path():
    """Under autocast both paths run the matmul in bf16 and the softmax in fp32; their error
    against an fp64 reference is of the same (bf16) size."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 32, generator=g, requires_grad=True)
    weight = (torch.randn(101, 32, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, 101, (64,), generator=g)
    exact = _reference(hidden.double(), weight.double(), targets)
    exact_grads = torch.autograd.grad(exact, [hidden, weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=10)
        ref = _reference(hidden, weight, targets)
    assert ours.dtype == torch.float32
    ours_grads, ref_grads = torch.autograd.grad(ours, [hidden, weight]), torch.autograd.grad(ref, [hidden, weight])
    assert abs(ours.item() - exact.item()) <= 2 * abs(ref.item() - exact.item()) + 1e-3 * abs(exact.item())
    for o, r, e in zip(ours_grads, ref_grads, exact_grads):
        assert o.dtype == torch.float32
        assert (o - e).abs().max() <= 2 * (r - e).abs().max() + 1e-6


def test_bad_shapes_name_both_shapes():
    with pytest.raises(ValueError, match=r"\[V, 8\].*\(5, 4\)"):
        chunked_linear_cross_entropy(torch.randn(3, 8), torch.randn(5, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="targets"):
        chunked_linear_cross_entropy(torch.randn(3, 8), torch.randn(5, 8), torch.zeros(4, dtype=torch.long))


def test_shifted_targets_pair_position_t_with_label_t_plus_1():
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7]])
    assert shifted_targets(labels).tolist() == [[6, IGNORE_INDEX, 7, IGNORE_INDEX]]


class _CountMatmuls(TorchDispatchMode):
    """Counts the multiply-adds of the matrix products torch runs inside the block (``macs``)."""

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2:] if packet != torch.ops.aten.mm else args[:2]
            self.macs += a.shape[0] * a.shape[1] * b.shape[1]
        elif packet == torch.ops.mkldnn._linear_pointwise:  # X [m, k] times W [n, k] transposed
            self.macs += args[0].shape[0] * args[0].shape[1] * args[1].shape[0]
        return func(*args, **(kwargs or {}))


@pytest.fixture(params=["onednn", "torch"])
def cpu_gemm(request, monkeypatch):
    """Both ways the chunked loss multiplies on CPU in fp32: oneDNN's kernel and torch.mm."""
    if request.param == "torch":
        monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    elif _onednn_linear() is None:
        pytest.skip("this PyTorch build cannot run oneDNN's linear kernel")
    return request.param


def _problem(n=40, h=12, v=50, ignored=0.3, seed=3, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    b = torch.randn(v, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    targets[torch.rand(n, generator=g) < ignored] = IGNORE_INDEX
    return hidden, weight, b, targets


@pytest.mark.parametrize("hidden_grad, weight_grad, bias_grad, per_chunk",
                         [(True, True, False, 3), (True, True, True, 3), (True, False, False, 2),
                          (False, True, False, 2), (False, False, True, 1)])
def test_gradients_are_made_in_the_forward_pass_three_matmuls_per_chunk(hidden_grad, weight_grad, bias_grad,
                                                                        per_chunk, cpu_gemm):
    """Logits, hidden gradient, weight gradient per chunk, only those that something needs
    (the products' multiply-adds add up to that many ``rows x hidden x vocab``); backward
    runs no matmul at all (nothing is recomputed) and still equals the reference."""
    hidden, weight, bias, targets = _problem(bias=bias_grad)
    hidden.requires_grad_(hidden_grad)
    weight.requires_grad_(weight_grad)
    inputs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    rows = int((targets != IGNORE_INDEX).sum())
    with _CountMatmuls() as forward:
        ours = chunked_linear_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=7)
    with _CountMatmuls() as backward:
        grads = torch.autograd.grad(ours * 1.7, inputs)
    assert forward.macs == per_chunk * rows * weight.shape[1] * weight.shape[0] and backward.macs == 0
    ref = _reference(hidden, weight, targets, bias)
    for a, b in zip(grads, torch.autograd.grad(ref * 1.7, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_no_grad_forward_does_no_gradient_work(cpu_gemm):
    """Evaluation (grad disabled): the logits product only, the same value, nothing to backward."""
    hidden, weight, _, targets = _problem()
    rows = int((targets != IGNORE_INDEX).sum())
    with torch.no_grad(), _CountMatmuls() as counted:
        value = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=6)
    assert counted.macs == rows * weight.shape[1] * weight.shape[0] and not value.requires_grad
    torch.testing.assert_close(value, _reference(hidden, weight, targets).detach(), rtol=1e-6, atol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=6), value)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_activation_checkpointing_runs_the_forward_twice_and_the_gradients_stay_exact(use_reentrant, with_bias):
    """Under checkpointing the loss's forward runs again in backward: the non-reentrant
    checkpoint discards the first pass's saved gradients and uses the recomputed ones, the
    reentrant one runs the first pass without grad. Either way: the reference's gradients."""
    hidden, weight, bias, targets = _problem(bias=with_bias, seed=5)
    calls = []

    def segment(h):
        calls.append(torch.is_grad_enabled())
        return chunked_linear_cross_entropy(torch.tanh(h), weight, targets, bias=bias, chunk_size=9)

    inputs = [t for t in (hidden, weight, bias) if t is not None]
    ours = checkpoint(segment, hidden, use_reentrant=use_reentrant)
    (ours * 0.6).backward()  # the reentrant checkpoint supports .backward() only
    grads = [t.grad.clone() for t in inputs]
    assert len(calls) == 2 and calls[1] is True and calls[0] is (not use_reentrant)
    ref = _reference(torch.tanh(hidden), weight, targets, bias)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-5)
    for a, b in zip(grads, torch.autograd.grad(ref * 0.6, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_backward_twice_with_a_kept_graph_gives_each_scale_its_own_gradient():
    hidden, weight, _, targets = _problem(seed=6)
    ours = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    first = torch.autograd.grad(ours * 2.0, [hidden, weight], retain_graph=True)
    second = torch.autograd.grad(ours * -0.5, [hidden, weight])
    ref = _reference(hidden, weight, targets)
    for scale, grads in ((2.0, first), (-0.5, second)):
        for a, b in zip(grads, torch.autograd.grad(ref * scale, [hidden, weight], retain_graph=True)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(ours, [hidden, weight])


def test_a_loss_joined_with_the_model_outputs_keeps_its_value_and_gradients_and_reaches_every_output():
    """What FSDP2 needs: the hooks on the forward's outputs run in backward (with zero gradients)
    although the loss does not read them; the loss and its gradients are unchanged."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    hidden, weight, _, targets = _problem(seed=7)
    logits = hidden[:1] @ weight.t()  # the one position per row a model returns under logits_to_keep=1
    output = CausalLMOutputWithPast(logits=logits, hidden_states=(hidden * 2,))
    seen = []
    for tensor in (logits, output.hidden_states[0]):
        tensor.register_hook(lambda grad: seen.append(grad.abs().max().item()))
    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=8)
    joined = joined_with_outputs(loss, output)
    assert joined.item() == loss.item()
    joined.backward()
    assert seen == [0.0, 0.0]  # each output hook ran once, with a zero gradient
    ref_hidden, ref_weight = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    _reference(ref_hidden, ref_weight, targets).backward()
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_weight.grad, rtol=1e-5, atol=1e-6)
    # Nothing to join (no output needs a gradient): the loss itself.
    assert joined_with_outputs(loss, CausalLMOutputWithPast(logits=logits.detach())) is loss


def test_every_shape_chunking_and_label_mask_equals_materialized():
    """Random sizes, chunk sizes (1 to more than the rows), label masks (none to all ignored),
    bias, upstream scales and which inputs need gradients, in fp64 so only algebra can differ."""
    g = torch.Generator().manual_seed(11)
    for case in range(60):
        n, h, v = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 40), (1, 9), (2, 30)))
        chunk = int(torch.randint(1, n + 3, (1,), generator=g))
        ignored = float(torch.rand(1, generator=g))
        hidden = torch.randn(n, h, dtype=torch.float64, generator=g).requires_grad_(case % 4 != 1)
        weight = torch.randn(v, h, dtype=torch.float64, generator=g).requires_grad_(case % 4 != 2)
        bias = torch.randn(v, dtype=torch.float64, generator=g).requires_grad_() if case % 3 == 0 else None
        targets = torch.randint(0, v, (n,), generator=g)
        targets[torch.rand(n, generator=g) < ignored] = IGNORE_INDEX
        scale = float(torch.randn(1, generator=g))
        inputs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
        ours = chunked_linear_cross_entropy(hidden, weight, targets, bias=bias, chunk_size=chunk)
        logits = hidden @ weight.t() + (0 if bias is None else bias)  # fp64 throughout
        ref = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
        msg = f"case {case}: n={n} h={h} v={v} chunk={chunk} ignored={ignored:.2f}"
        torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12, msg=msg)
        for a, b in zip(torch.autograd.grad(ours * scale, inputs), torch.autograd.grad(ref * scale, inputs)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=msg)


def test_bf16_hidden_states_get_a_bf16_gradient_as_accurate_as_materialized():
    """The GPU case: bf16 hidden states, an fp32 weight, bf16 autocast. The hidden gradient is
    stored in bf16 and scaled in fp32 in backward; errors stay of the materialised path's size."""
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(48, 32, generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(90, 32, generator=g) * 0.3).requires_grad_()
    targets = torch.randint(0, 90, (48,), generator=g)
    targets[:10] = IGNORE_INDEX
    exact = _reference(hidden.double(), weight.double(), targets)
    exact_grads = torch.autograd.grad(exact * 0.01, [hidden, weight])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=16)
        ref = _reference(hidden, weight, targets)
    ours_grads = torch.autograd.grad(ours * 0.01, [hidden, weight])
    ref_grads = torch.autograd.grad(ref * 0.01, [hidden, weight])
    assert ours_grads[0].dtype == torch.bfloat16 and ours_grads[1].dtype == torch.float32
    assert abs(ours.item() - exact.item()) <= 2 * abs(ref.item() - exact.item()) + 1e-3 * abs(exact.item())
    for o, r, e in zip(ours_grads, ref_grads, exact_grads):
        assert (o.double() - e).abs().max() <= 2 * (r.double() - e).abs().max() + 1e-7


@pytest.mark.parametrize("requested", LOSS_IMPLS)
@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("liger", [False, True])
@pytest.mark.parametrize("head_problem", ["", "LoRA output head with DeepSpeed ZeRO-3 parameters"])
def test_choose_loss_impl_on_every_device_liger_and_head(requested, device_type, liger, head_problem):
    fused_runs = device_type == "cuda" and liger
    if requested == "fused" and not fused_runs:
        missing = "CUDA" if device_type != "cuda" else "liger-kernel"
        with pytest.raises(ValueError, match=f"loss_impl=fused needs {missing}.*use training.loss_impl=chunked"):
            choose_loss_impl(requested, device_type=device_type, head_problem=head_problem, liger=liger)
        return
    choice = choose_loss_impl(requested, device_type=device_type, head_problem=head_problem, liger=liger)
    wanted = ("fused" if fused_runs else "chunked") if requested == "auto" else requested
    if head_problem and wanted != "materialized":
        assert choice == LossChoice("materialized", head_problem)
    else:
        assert choice == LossChoice(wanted)


def test_choose_loss_impl_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="loss_impl='fast': use one of auto, chunked, fused, materialized"):
        choose_loss_impl("fast", device_type="cpu")


def test_unknown_config_values_fail_at_start_up(tmp_path, synthetic_dir, tiny_overrides):
    from mmtune.training.config import ConfigError, to_sft_config
    from mmtune.training.demo import compose_sft_config

    with pytest.raises(ConfigError, match="training.loss_impl='fast'.*\n.*training.loss_chunk_size=0"):
        to_sft_config(compose_sft_config(tiny_overrides(tmp_path, synthetic_dir, "training.loss_impl=fast",
                                                        "training.loss_chunk_size=0")))


# -- whole models: both families, packed and padded --------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    adapter = build_adapter(ModelConfig(family=request.param))
    torch.manual_seed(0)
    model = adapter.load_model(seed=0) if request.param == "llava" else adapter.load_model()
    model.train()
    return adapter, model


def _sample(adapter, model, *, seed, text=(9, 14, 12), trainable=(False, True, True)):
    """ids/labels of text spans around one image; trainable spans are labelled with their ids."""
    g = torch.Generator().manual_seed(seed)
    vocab = adapter.text_config(model.config).vocab_size
    num_image = adapter.image_token_count(Image("/unused.png"))
    ids, labels = [], []
    for i, (n, train) in enumerate(zip(text, trainable)):
        span = torch.randint(10, vocab, (n,), generator=g)
        span[span == adapter.image_token_id] = 11
        ids += span.tolist()
        labels += span.tolist() if train else [IGNORE_INDEX] * n
        if i == 0:
            ids += [adapter.image_token_id] * num_image
            labels += [IGNORE_INDEX] * num_image
    size = model.config.vision_config.image_size
    pixels = torch.randn(1, 3, size, size, generator=g)
    return ids, labels, pixels


def _padded(samples, pad_id):
    length = max(len(ids) for ids, _, _ in samples)
    ids = torch.tensor([s[0] + [pad_id] * (length - len(s[0])) for s in samples])
    labels = torch.tensor([s[1] + [IGNORE_INDEX] * (length - len(s[1])) for s in samples])
    mask = torch.tensor([[1] * len(s[0]) + [0] * (length - len(s[0])) for s in samples])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
              "pixel_values": torch.cat([s[2] for s in samples])}
    return inputs, labels


def _packed(samples):
    ids = torch.tensor([sum((s[0] for s in samples), [])])
    labels = torch.tensor([sum((s[1] for s in samples), [])])
    positions = torch.tensor([sum((list(range(len(s[0]))) for s in samples), [])])
    inputs = {"input_ids": ids, "attention_mask": None, "position_ids": positions,
              "pixel_values": torch.cat([s[2] for s in samples])}
    return inputs, labels


def _run(adapter, model, inputs, labels, impl, chunk_size=5):
    """Loss, final-hidden-state gradient and every parameter gradient of one backward."""
    body, _ = adapter.loss_modules(model)
    kept = []

    def keep(_module, _args, output):
        output.last_hidden_state.retain_grad()
        kept.append(output.last_hidden_state)

    loss_fn = TrainingLoss(adapter, model, impl=impl, chunk_size=chunk_size)
    assert loss_fn.impl == impl
    handle = body.register_forward_hook(keep)
    torch.manual_seed(0)  # the same dropout masks (Partial LoRA has dropout) in both runs
    try:
        loss = loss_fn(model, inputs, labels)
    finally:
        handle.remove()
    (loss * 0.5).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), kept[-1].grad, grads


def _assert_same(adapter, model, inputs, labels, *, atol=1e-5):
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    loss_c, hidden_c, grads_c = _run(adapter, a, inputs, labels, "chunked")
    loss_m, hidden_m, grads_m = _run(adapter, b, inputs, labels, "materialized")
    torch.testing.assert_close(loss_c, loss_m, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(hidden_c, hidden_m, rtol=1e-5, atol=atol)
    assert grads_c.keys() == grads_m.keys() and grads_c
    for name in grads_m:
        torch.testing.assert_close(grads_c[name], grads_m[name], rtol=1e-5, atol=atol, msg=name)
    return grads_c


def _chunk_boundary_inside_first_sample(labels):
    rows = int((shifted_targets(labels[:1]) != IGNORE_INDEX).sum())
    return rows > 5 and rows % 5 != 0


def test_padded_batch_matches_materialized(family):
    adapter, model = family
    samples = [_sample(adapter, model, seed=0), _sample(adapter, model, seed=1, text=(5, 7, 20))]
    inputs, labels = _padded(samples, adapter.tokenizer.pad_token_id or 0)
    assert _chunk_boundary_inside_first_sample(labels)
    grads = _assert_same(adapter, model, inputs, labels)
    head_name = "lm_head.weight" if adapter.family == "llava" else "output.weight"
    assert grads[head_name].abs().max() > 0


def test_packed_row_matches_materialized(family):
    adapter, model = family
    samples = [_sample(adapter, model, seed=2), _sample(adapter, model, seed=3, text=(3, 6, 17))]
    inputs, labels = _packed(samples)
    assert _chunk_boundary_inside_first_sample(labels)
    _assert_same(adapter, model, inputs, labels)


def test_lora_on_the_output_head_matches_materialized(family):
    from peft import LoraConfig, get_peft_model

    adapter, model = family
    head = "lm_head" if adapter.family == "llava" else "output"
    targets = [n for n, _ in model.named_modules() if n.endswith(("q_proj", "wqkv", head))
               and "vision" not in n and not n.startswith("vit")]
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                                 target_modules=targets))
    with torch.no_grad():  # peft starts B at zero, which would hide A's gradient
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    _, head_module = adapter.loss_modules(peft_model)
    assert output_head(head_module)[0].kind == "lora"
    inputs, labels = _packed([_sample(adapter, model, seed=4), _sample(adapter, model, seed=5)])
    grads = _assert_same(adapter, peft_model, inputs, labels)
    head_lora = [n for n in grads if f"{head}.lora_" in n]
    assert len(head_lora) == 2 and all(grads[n].abs().max() > 0 for n in head_lora)
    assert any("lora_" in n and head not in n for n in grads)


def test_lora_dropout_on_the_output_head_falls_back_with_a_reason(family):
    from peft import LoraConfig, get_peft_model

    adapter, model = family
    head = "lm_head" if adapter.family == "llava" else "output"
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, lora_dropout=0.1, target_modules=[head]))
    loss_fn = TrainingLoss(adapter, peft_model, impl="auto")
    assert loss_fn.impl == "materialized"
    assert "dropout" in loss_fn.reason and "fallback" in loss_fn.description


def test_lora_output_head_under_zero3_falls_back_with_a_reason():
    from peft import LoraConfig, get_peft_model

    from mmtune.training.engines.deepspeed import DeepSpeedEngine

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_dropout=0.0, target_modules=["0"]))
    lora_head = peft_model.base_model.model[0]
    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # head_problem reads the module only
    assert engine.head_problem(lora_head) == "" and output_head(lora_head)[0].kind == "lora"
    lora_head.lora_B["default"].weight.ds_id = 7  # what deepspeed.zero.Init leaves on a parameter
    head, reason = output_head(lora_head, engine.head_problem(lora_head))
    assert head is None and "ZeRO-3" in reason


def test_training_loss_runs_the_head_on_one_position_only(family):
    adapter, model = family
    _, head = adapter.loss_modules(model)
    seen = []
    handle = head.register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    inputs, labels = _packed([_sample(adapter, model, seed=6)])
    try:
        TrainingLoss(adapter, model, impl="chunked")(model, inputs, labels)
    finally:
        handle.remove()
    hidden_size = adapter.text_config(model.config).hidden_size
    # once inside the model (logits_to_keep=1), once as the loss (the whole row, never as logits)
    assert seen == [(1, 1, hidden_size), (1, labels.shape[1], hidden_size)]


def test_hidden_state_hook_keeps_nothing_outside_the_loss_call(family):
    adapter, model = family
    loss_fn = TrainingLoss(adapter, model, impl="chunked")
    inputs, labels = _packed([_sample(adapter, model, seed=8)])
    first = loss_fn(model, inputs, labels)
    with torch.no_grad():
        model(**inputs)  # e.g. evaluation between steps: the persistent hook must not hold its output
    assert loss_fn._captured == []
    torch.testing.assert_close(loss_fn(model, inputs, labels), first)


def test_materialized_helper_equals_the_model_loss(family):
    adapter, model = family
    inputs, labels = _packed([_sample(adapter, model, seed=7)])
    with torch.no_grad():
        logits = model(**inputs).logits
        _, head = adapter.loss_modules(model)
        body_out = []
        handle = adapter.loss_modules(model)[0].register_forward_hook(
            lambda _m, _a, out: body_out.append(out.last_hidden_state))
        model(**inputs)
        handle.remove()
        summed = linear_cross_entropy_sum(body_out[0], head, labels, impl="chunked", chunk_size=3)
    torch.testing.assert_close(summed, materialized_cross_entropy_sum(logits, labels), rtol=1e-6, atol=1e-5)


# -- one resolution: what the loop chooses is what `mmtune plan` predicts ------------------------

_HEAD = object()  # stands for the family's output head in the target lists below

PEFT_CASES = {  # name: (method, target_modules, dropout, zero_stage, falls back)
    "full": ("none", None, 0.05, 0, False),
    "full-zero3": ("none", None, 0.05, 3, False),  # a plain head is gathered under ZeRO-3
    "lora-default-targets": ("lora", None, 0.05, 0, False),
    "lora-head": ("lora", ["q_proj", "wqkv", _HEAD], 0.0, 0, False),
    "lora-head-dropout": ("lora", ["q_proj", "wqkv", _HEAD], 0.05, 0, True),
    "lora-head-zero3": ("lora", [_HEAD], 0.0, 3, True),
    "lora-head-dropout-zero3": ("lora", [_HEAD], 0.1, 3, True),
}


@pytest.mark.parametrize("requested", ["auto", "chunked", "materialized"])
@pytest.mark.parametrize("case", PEFT_CASES)
def test_plan_predicts_the_loss_the_loop_chooses(family, requested, case):
    """The loop reads the live (LoRA-wrapped, ZeRO-3-marked) model, the plan only the config
    and a model without peft; both must land on the same implementation and reason."""
    from types import SimpleNamespace

    from mmtune.training.peft_setup import apply_lora

    adapter, model = family
    method, targets, dropout, zero_stage, falls_back = PEFT_CASES[case]
    head_name = "lm_head" if adapter.family == "llava" else "output"
    if targets is not None:
        names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets = [head_name if t is _HEAD else t for t in targets if t is _HEAD or t in names]
    peft_cfg = PeftConfig(method=method, r=2, alpha=4, dropout=dropout, target_modules=targets)
    live = copy.deepcopy(model)
    if method != "none":
        live = apply_lora(live, adapter.module_groups(live), peft_cfg, adapter.default_lora_targets)
    from mmtune.training.config import BackendConfig
    from mmtune.training.engines.deepspeed import DeepSpeedEngine

    engine = None
    backend = BackendConfig(engine="deepspeed" if zero_stage else "ddp")
    backend.deepspeed.stage = zero_stage or 3
    if zero_stage == 3:
        for param in live.parameters():
            param.ds_id = 0  # what deepspeed.zero.Init leaves on every parameter
        engine = DeepSpeedEngine.__new__(DeepSpeedEngine)  # head_problem reads the module only
    loop = TrainingLoss(adapter, live, impl=requested, device="cuda", engine=engine)
    cfg = SimpleNamespace(model=ModelConfig(family=adapter.family), peft=peft_cfg,
                          training=SimpleNamespace(loss_impl=requested, backend=backend))
    planned = planned_loss_impl(cfg, model)
    assert planned == LossChoice(loop.impl, loop.reason)
    linear = choose_loss_impl(requested, device_type="cuda").impl
    assert planned.impl == ("materialized" if falls_back else linear)
    assert bool(planned.reason) == (falls_back and linear != "materialized")


def test_plan_run_estimates_the_loss_the_loop_will_run(tmp_path, synthetic_dir, tiny_overrides):
    from mmtune.training.plan import PlanError, plan_run

    def planned(*extra):
        return plan_run(tiny_overrides(tmp_path, synthetic_dir, *extra), num_gpus=1, gpu="h100").cost["formula"]

    linear = choose_loss_impl("auto", device_type="cuda").impl
    assert f"training.loss_impl={linear}:" in planned("training.loss_impl=auto")
    lora_head = ("peft=lora", "peft.target_modules=[q_proj,lm_head]")
    assert f"training.loss_impl={linear}:" in planned(*lora_head, "peft.dropout=0")
    assert "training.loss_impl=materialized:" in planned(*lora_head, "peft.dropout=0.05")
    if linear != "fused":  # Liger is not installed here: the run could not start, so the plan says so
        with pytest.raises(PlanError, match="loss_impl=fused needs liger-kernel"):
            planned("training.loss_impl=fused")
    # the rendered plan names the loss and, for a fallback, the loop's own reason
    fallback = plan_run(tiny_overrides(tmp_path, synthetic_dir, *lora_head, "peft.dropout=0.05"), num_gpus=1,
                        gpu="h100")
    [line] = [x for x in fallback.render().splitlines() if x.strip().startswith("loss ")]
    assert "materialised logits" in line and "LoRA output head" in line and "dropout" in line
    [line] = [x for x in plan_run(tiny_overrides(tmp_path, synthetic_dir), num_gpus=1, gpu="h100").render().splitlines()
              if x.strip().startswith("loss ")]
    assert ("chunked linear cross-entropy" if linear == "chunked" else "fused") in line and ";" not in line


# -- DeepSpeed ZeRO-3, one CPU process through accelerate ----------------------------------------


@pytest.mark.slow
def test_zero3_chunked_gradients_equal_materialized(tmp_path, synthetic_dir, tiny_overrides):
    """The output weight is partitioned under ZeRO-3; the chunked loss gathers it in forward and
    backward and every gathered gradient equals the materialised path's."""
    results = {}
    for impl in ("chunked", "materialized"):
        overrides = tiny_overrides(tmp_path / impl, synthetic_dir, f"training.loss_impl={impl}",
                                   "training.loss_chunk_size=16",
                                   "training.backend.engine=deepspeed", "training.backend.deepspeed.stage=3",
                                   f"training.backend.deepspeed.config_file={REPO}/launch/deepspeed/zero3.json")
        results[impl] = zero3_loss(tmp_path / f"{impl}.pt", overrides)
    chunked, materialized = results["chunked"], results["materialized"]
    assert chunked["head_status"] == "NOT_AVAILABLE"  # the head really is partitioned
    assert chunked["description"].startswith("chunked")
    assert chunked["loss"] == pytest.approx(materialized["loss"], rel=1e-6)
    assert chunked["grads"].keys() == materialized["grads"].keys()
    for name, grad in materialized["grads"].items():
        torch.testing.assert_close(chunked["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    assert chunked["grads"]["lm_head.weight"].abs().max() > 0


def test_fused_path_hands_liger_our_conventions(monkeypatch):
    """Liger needs CUDA; this checks only the call we make (arguments, shift, sum) with a stand-in
    that has Liger's signature and computes the plain cross-entropy."""
    import types

    calls = []

    def liger_fused_linear_cross_entropy(input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                                         lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
                                         softcap=None, return_z_loss=False, accum_dtype=None):
        calls.append({"shape": tuple(input.shape), "ignore_index": ignore_index, "reduction": reduction,
                      "accum_dtype": accum_dtype})
        return F.cross_entropy(input @ weight.t(), target, ignore_index=ignore_index, reduction=reduction)

    module = types.ModuleType("liger_kernel.transformers.functional")
    module.liger_fused_linear_cross_entropy = liger_fused_linear_cross_entropy
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.functional", module)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(2, 7, 8, requires_grad=True)
    labels = torch.randint(0, 30, (2, 7))
    labels[0, :3] = IGNORE_INDEX
    fused = linear_cross_entropy_sum(hidden, head, labels, impl="fused")
    reference = materialized_cross_entropy_sum(head(hidden), labels)
    torch.testing.assert_close(fused, reference)
    assert calls == [{"shape": (14, 8), "ignore_index": IGNORE_INDEX, "reduction": "sum",
                      "accum_dtype": torch.float32}]

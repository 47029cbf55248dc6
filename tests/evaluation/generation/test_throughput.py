import math

import pytest

from mmtune.evaluation.benchmarks.base import BenchmarkWork
from mmtune.evaluation.config import EvalConfig, GenerationConfig, validate_eval_config
from mmtune.evaluation.generation.throughput import (
    DECODE_EFFICIENCY,
    PREFILL_MFU,
    QUESTION_TOKENS,
    estimate_generation,
    resolve_batch_size,
)
from mmtune.models.config import ModelConfig
from mmtune.training.plan import GPU_TYPES, ParamCounts
from mmtune.training.plan.evaluation import plan_generation, render_generation_estimates


def test_batch_size_by_model_size():
    cfg = GenerationConfig()
    assert resolve_batch_size(cfg, 3_000_000) == 16  # tiny test models
    assert resolve_batch_size(cfg, 7_060_000_000) == 8  # LLaVA-1.5-7B
    assert resolve_batch_size(cfg, 8_670_000_000) == 8  # InternLM-XC2-VL-7B
    assert resolve_batch_size(cfg, 13_350_000_000) == 4  # LLaVA-1.5-13B
    assert resolve_batch_size(cfg, 70_000_000_000) == 2
    assert resolve_batch_size(GenerationConfig(batch_size=3), 7_000_000_000) == 3  # an explicit size wins
    with pytest.raises(ValueError, match="no entry for a model of 13.4B"):
        resolve_batch_size(GenerationConfig(batch_size_by_size={"9B": 8}), 13_400_000_000)
    with pytest.raises(ValueError, match="'7 billion'"):
        resolve_batch_size(GenerationConfig(batch_size_by_size={"7 billion": 8}), 1)
    cfg = EvalConfig(generation=GenerationConfig(batch_size=0))
    with pytest.raises(ValueError, match="batch_size=0"):
        validate_eval_config(cfg)


def test_estimate_follows_the_stated_model():
    kw = dict(dialogues=10, answers=40, images=20, tokens_per_image=100, answer_tokens=50, params=10**9,
              weight_bytes=2e9, kv_bytes_per_token=1e5, window=4096, hbm_tbps=2.0, peak_tflops=300.0)
    est = estimate_generation("x", batch_size=8, **kw)
    per_turn = (20 * 100 + 40 * QUESTION_TOKENS) / 40
    context = (4 + 1) / 2 * (per_turn + 50)
    step = (2e9 + 8 * 1e5 * context) / (2.0e12 * DECODE_EFFICIENCY)
    prefill = 2 * 1e9 * 40 * per_turn / (300e12 * PREFILL_MFU)
    assert est.rounds == 5 and est.forward_calls == 5 * 50 and est.decode_tokens == 40 * 50
    assert est.prefill_tokens == int(40 * per_turn)
    assert est.hours == pytest.approx((5 * 50 * step + prefill) / 3600)
    assert est.decode_tokens_per_s == pytest.approx(8 / step)
    # batching: far fewer weight reads, so several times faster, but less than 8x (the KV term)
    assert 4 < est.hours_batch1 / est.hours < 8
    # re-encoding prefills the history every turn
    again = estimate_generation("x", batch_size=8, kv_reuse=False, **kw)
    assert again.prefill_tokens == int(10 * sum(t * (per_turn + 50) for t in range(1, 5)))
    assert again.hours > est.hours


def test_plan_estimates_generation_per_benchmark():
    params = ParamCounts(total=7_063_000_000, vision=303_000_000, projector=21_000_000, language_model=6_739_000_000,
                         trainable=0, trainable_language_model=0, lora=0, hidden_size=4096, num_layers=32,
                         vocab_size=32064, image_tokens=576, source="test")
    model = ModelConfig(family="llava", path="llava-hf/llava-1.5-7b-hf", torch_dtype="bfloat16")
    benches = [BenchmarkWork("mmdu", "b.json", 110, 1645, 1645, 421), BenchmarkWork("mmvet", "m.json", 218, 218, 1090, 218),
               BenchmarkWork("lmms_eval", None, 0, 0, 0, 0)]
    gen = GenerationConfig(max_new_tokens=2048, context_length=8192)
    out = plan_generation(gen, model, params, benches, GPU_TYPES["h100"])
    assert [e["benchmark"] for e in out] == ["mmdu", "mmvet"]
    mmdu = out[0]
    assert mmdu["batch_size"] == 8 and mmdu["rounds"] == math.ceil(1645 / 8)
    assert mmdu["hours_batch1"] / mmdu["hours"] > 3
    # LLaVA-1.5-7B in bf16 at batch 1 on an H100: weights (14 GB) read once per token
    assert 100 < 1 / (14.1e9 / (3.35e12 * DECODE_EFFICIENCY)) < 150
    text = "\n".join(render_generation_estimates(out))
    assert "mmdu" in text and "B=8" in text and "GPU-h" in text


def test_data_parallel_estimate_is_the_largest_share():
    from mmtune.evaluation.generation.throughput import estimate_data_parallel

    kw = dict(tokens_per_image=576, answer_tokens=2048, batch_size=8, params=7 * 10**9, weight_bytes=14e9,
              kv_bytes_per_token=5e5, window=8192, hbm_tbps=2.0, peak_tflops=312.0)
    one = estimate_generation("mmdu", dialogues=110, answers=1645, images=421, **kw)
    used, share = estimate_data_parallel("mmdu", gpus=1, dialogues=110, answers=1645, images=421, **kw)
    assert used == 1 and share == one
    previous = one.hours
    for gpus in (2, 4, 8, 16, 110, 200):
        used, share = estimate_data_parallel("mmdu", gpus=gpus, dialogues=110, answers=1645, images=421, **kw)
        per_rank = math.ceil(110 / used)
        assert used == min(gpus, 110) and share.answers == math.ceil(1645 * per_rank / 110)
        assert share == estimate_generation("mmdu", dialogues=per_rank, answers=share.answers,
                                            images=math.ceil(421 * per_rank / 110), **kw)
        assert share.hours <= previous  # more GPUs never take longer
        assert share.hours * used >= one.hours * 0.99  # and never do less work in total
        previous = share.hours

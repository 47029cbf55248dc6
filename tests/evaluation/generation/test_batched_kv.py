"""Batched KV generation: answers equal the batch-1 KV path and the re-encode path.

Greedy decoding in fp32 on tiny random models. The dialogues differ in number of turns,
images per turn and text length; one of them overflows the window, so its cache row is
rolled back to a common prefix when the oldest exchanges are dropped. The stop token's
output row is scaled up so answers stop at different steps (a random model would
otherwise run every answer to max_new_tokens and never leave a row idle).
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue
from mmtune.evaluation.generation.batched_kv import BatchedKVCache
from mmtune.evaluation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator, read_generations
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter

WINDOW = 330
"""Context window of the tests: every dialogue fits but ``long``."""


def _stopping(adapter, model):
    """Scale the stop token's output row so greedy answers end at different lengths."""
    with torch.no_grad():
        model.get_output_embeddings().weight[adapter.stop_token_ids[0]] *= 3.0
    return model


@pytest.fixture(scope="module")
def llava():
    adapter = build_adapter(ModelConfig(family="llava"))
    return adapter, _stopping(adapter, adapter.load_model(seed=0))


@pytest.fixture(scope="module")
def xcomposer2():
    yaml = Path(__file__).resolve().parents[3] / "configs" / "model" / "internlm_xc2_tiny.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(yaml)))
    adapter = build_adapter(cfg)
    return adapter, _stopping(adapter, adapter.load_model())


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory, mixed_dialogues):
    root = tmp_path_factory.mktemp("imgs")
    paths = []
    for i, colour in enumerate(["red", "green", "blue", "yellow", "purple", "orange", "white"]):
        path = root / f"{i}.png"
        PILImage.new("RGB", (36 + 5 * i, 30 + 3 * i), colour).save(path)
        paths.append(str(path))
    return mixed_dialogues(paths)


def _answers(records):
    return [(r.dialogue_id, r.turn, r.answer) for r in records]


def _fields(records):
    """Everything a record says except how many tokens were fed (that depends on the path)."""
    return [(r.dialogue_id, r.turn, r.answer, r.prompt_tokens, r.new_tokens, r.finish_reason, r.context) for r in records]


_RUNS: dict = {}


def _run(adapter, model, dialogues, **settings):
    """Records and stats of one generation run; runs the tests share are made once."""
    key = (id(model), tuple(d.id for d in dialogues), tuple(sorted(settings.items())))
    if key not in _RUNS:
        cfg = GenerationConfig(max_new_tokens=8, context_length=WINDOW, min_new_tokens=8,
                               **{"batch_schedule": "continuous", **settings})
        gen = DialogueGenerator(adapter, model, cfg)
        _RUNS[key] = (gen.generate(dialogues), dict(gen.stats))
    return _RUNS[key]


def _check_exact(adapter, model, dialogues):
    one, one_stats = _run(adapter, model, dialogues, batch_size=1)
    batched, stats = _run(adapter, model, dialogues, batch_size=4)
    reencoded, _ = _run(adapter, model, dialogues, kv_reuse=False, batch_size=3)
    # the workload is what the docstring says it is
    assert len({r.new_tokens for r in one}) >= 4 and {r.finish_reason for r in one} == {"stop", "length"}
    overflowed = {r.dialogue_id for r in one if r.context}
    assert overflowed == {"long"}
    assert stats["compactions"] >= 1 and stats["padding_tokens"] > 0
    # the same answers and per-turn records on every path
    assert _fields(batched) == _fields(one) == _fields(reencoded)
    # ... for the same real tokens as batch 1, in far fewer model calls
    assert [r.forward_tokens for r in batched] == [r.forward_tokens for r in one]
    assert stats["forward_tokens"] == one_stats["forward_tokens"]
    assert stats["forward_calls"] < 0.5 * one_stats["forward_calls"]


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_batched_kv_matches_batch1_and_reencode_llava(llava, dialogues, attn):
    adapter, model = llava
    if attn != "sdpa":
        model = _stopping(adapter, adapter.load_model(seed=0, attn_implementation=attn))
    _check_exact(adapter, model, dialogues)


def test_batched_kv_matches_batch1_and_reencode_internlm_xcomposer2(xcomposer2, dialogues):
    adapter, model = xcomposer2
    _check_exact(adapter, model, dialogues)


@pytest.mark.parametrize("batch_size", [2, pytest.param(16, marks=pytest.mark.slow)])
def test_batched_kv_any_batch_size(llava, dialogues, batch_size):
    """Fewer slots than dialogues (slots refilled many times) and more (the batch only shrinks)."""
    adapter, model = llava
    one, _ = _run(adapter, model, dialogues, batch_size=1)
    batched, _ = _run(adapter, model, dialogues, batch_size=batch_size)
    assert _fields(batched) == _fields(one)


def test_batched_kv_lockstep_schedule_gives_the_same_answers(llava, dialogues):
    """Rows starting turns together (after the longest answer) instead of as soon as they can."""
    adapter, model = llava
    one, _ = _run(adapter, model, dialogues, batch_size=1)
    continuous, stats = _run(adapter, model, dialogues, batch_size=4)
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=8, context_length=WINDOW, min_new_tokens=8,
                                                             batch_size=4, batch_schedule="lockstep"))
    assert _fields(gen.generate(dialogues)) == _fields(one)
    # waiting for the longest answer of the batch costs model calls
    assert stats["forward_calls"] < gen.stats["forward_calls"] and gen.stats["idle_tokens"] > 0


def test_batched_kv_overflow_stop_policy(llava, dialogues):
    adapter, model = llava
    one, _ = _run(adapter, model, dialogues, batch_size=1, overflow="stop")
    batched, _ = _run(adapter, model, dialogues, batch_size=4, overflow="stop")
    assert _fields(batched) == _fields(one)
    skipped = [r for r in batched if r.finish_reason == "context"]
    assert skipped and {r.dialogue_id for r in skipped} == {"long"} and all(r.answer is None for r in skipped)


def test_batched_kv_resumes_from_jsonl(llava, dialogues, tmp_path):
    adapter, model = llava
    cfg = GenerationConfig(max_new_tokens=8, context_length=WINDOW, min_new_tokens=8, batch_size=4,
                           batch_schedule="continuous")
    reference, _ = _run(adapter, model, dialogues, batch_size=4)
    out = tmp_path / "gen.jsonl"
    DialogueGenerator(adapter, model, cfg).generate(dialogues, out_path=out)
    lines = out.read_text().splitlines()
    assert len(lines) == len(reference)
    # a crash: 11 turns of several half-done dialogues written, the 12th torn mid-line
    out.write_text("\n".join(lines[:11]) + "\n" + lines[11][: len(lines[11]) // 2])
    resumed = DialogueGenerator(adapter, model, cfg)
    records = resumed.generate(dialogues, out_path=out)
    assert resumed.stats["turns"] == len(lines) - 11
    assert _fields(records) == _fields(reference)
    assert sorted((r["dialogue_id"], r["turn"]) for r in read_generations(out)) == sorted(
        (r.dialogue_id, r.turn) for r in reference
    )


def test_compact_keeps_what_every_row_attends_to(llava, dialogues):
    """Compaction moves cached keys between columns; the next step's logits do not change."""
    adapter, model = llava
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=4))
    prompts = []
    for d in dialogues[:3]:
        ids, images, _ = gen._encode(Dialogue(d.id, d.source, d.turns[:1]))
        prompts.append((ids, [img.path for img in images]))

    def step(compact: bool):
        with torch.inference_mode():
            kv = BatchedKVCache(gen._new_cache, 3, gen.device)
            feeds = [p[0] for p in prompts]
            positions, last = kv.extend(feeds, max(map(len, feeds)))
            pixels = adapter.preprocess_images([path for p in prompts for path in p[1]])
            ids = torch.tensor([f + [gen.pad_id] * (kv.length - len(f)) for f in feeds])
            gen._forward(ids, pixels, kv.mask, positions, kv.cache, keep=last)
            kv.keep(1, 5)  # roll one row back: holes in the middle of the cache
            if compact:
                before = kv.length
                kv.compact()
                assert kv.length == max(len(c) for c in kv.columns) < before
            tail = [[7, 8], [9], [10, 11]]
            positions, last = kv.extend(tail, 2)
            ids = torch.tensor([t + [gen.pad_id] * (2 - len(t)) for t in tail])
            return gen._forward(ids, None, kv.mask, positions, kv.cache, keep=last)

    torch.testing.assert_close(step(True), step(False), rtol=1e-5, atol=1e-5)


def test_batch_schedule_auto_is_lockstep_off_cuda_and_validated(llava):
    from mmtune.evaluation.config import EvalConfig, validate_eval_config

    adapter, model = llava
    assert DialogueGenerator(adapter, model, GenerationConfig()).prefill_policy == "lockstep"  # CPU
    assert DialogueGenerator(adapter, model, GenerationConfig(batch_schedule="continuous")).prefill_policy == "continuous"
    cfg = EvalConfig(benchmarks=["synthetic"], generation=GenerationConfig(batch_schedule="fast"))
    cfg.synthetic.data_path = "x.json"
    with pytest.raises(ValueError, match="batch_schedule='fast'"):
        validate_eval_config(cfg)

"""Generation with M-RoPE (the qwen2_vl family): batched KV answers equal batch 1 and re-encoding,
every generated token sits at the position transformers gives it, and transformers' own
``generate`` answers a first turn the same way.

Greedy decoding in fp32 on tiny random models. The dialogues differ in number of turns, images
per turn (images of different sizes: different grids, so different rope offsets per row) and text
length; three overflow the window, so rows are rolled back to a common prefix. The stop token's
output row is scaled up so answers stop at different steps.
"""

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue
from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator
from mmtune.models.config import ModelConfig
from mmtune.models.qwen2_vl import MODEL_TYPES
from mmtune.models.registry import build_adapter

WINDOW = 200


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory, mixed_dialogues):
    root = tmp_path_factory.mktemp("mrope_gen")
    paths = []
    rng = np.random.default_rng(0)  # fixed pixels: the workload checks below depend on the answers
    for i, (width, height) in enumerate([(36, 30), (90, 40), (30, 120), (200, 60), (64, 64), (120, 90), (50, 50)]):
        path = root / f"{i}.png"
        PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(str(path))
    return [d for d in mixed_dialogues(paths) if d.id != "d7"]


_MODELS: dict = {}


def _model(model_type):
    if model_type not in _MODELS:
        adapter = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": model_type}))
        model = adapter.load_model()
        with torch.no_grad():
            model.get_output_embeddings().weight[adapter.stop_token_ids[0]] *= 3.0
        _MODELS[model_type] = adapter, model
    return _MODELS[model_type]


def _fields(records):
    return [(r.dialogue_id, r.turn, r.answer, r.prompt_tokens, r.new_tokens, r.finish_reason, r.context) for r in records]


def _run(adapter, model, dialogues, **settings):
    cfg = GenerationConfig(max_new_tokens=8, context_length=WINDOW, min_new_tokens=8,
                           **{"batch_schedule": "continuous", **settings})
    gen = DialogueGenerator(adapter, model, cfg)
    return gen.generate(dialogues), dict(gen.stats)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_batched_kv_matches_batch1_and_reencode(model_type, dialogues):
    adapter, model = _model(model_type)
    one, one_stats = _run(adapter, model, dialogues, batch_size=1)
    batched, stats = _run(adapter, model, dialogues, batch_size=4)
    reencoded, _ = _run(adapter, model, dialogues, kv_reuse=False, batch_size=3)
    # the workload is what the docstring says it is
    assert len({r.new_tokens for r in one}) >= 4 and {r.finish_reason for r in one} == {"stop", "length"}
    assert "long" in {r.dialogue_id for r in one if r.context}
    assert stats["compactions"] >= 1 and stats["padding_tokens"] > 0
    assert _fields(batched) == _fields(one) == _fields(reencoded)
    assert [r.forward_tokens for r in batched] == [r.forward_tokens for r in one]
    assert stats["forward_calls"] < 0.5 * one_stats["forward_calls"]


def test_lockstep_schedule_gives_the_same_answers(dialogues):
    adapter, model = _model("qwen2_vl")
    one, _ = _run(adapter, model, dialogues, batch_size=1)
    lockstep, _ = _run(adapter, model, dialogues, batch_size=3, batch_schedule="lockstep")
    assert _fields(lockstep) == _fields(one)


class _Positions:
    """Records, per row, the tokens a batched run feeds and the M-RoPE rows it gives them."""

    def __init__(self, model, rows):
        self.tokens = [[] for _ in range(rows)]
        self.positions = [[] for _ in range(rows)]
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, _module, _args, kwargs):
        ids, mask, positions = kwargs["input_ids"], kwargs["attention_mask"], kwargs["position_ids"]
        assert positions.shape[:2] == (4, ids.shape[0])  # [text row + 3 M-RoPE rows, B, W]
        real = mask[:, -ids.shape[1]:].bool()
        for b in range(ids.shape[0]):
            self.tokens[b] += ids[b, real[b]].tolist()
            self.positions[b].append(positions[1:, b, real[b]])


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_fed_token_has_the_position_transformers_gives_it(model_type, dialogues):
    """One turn per dialogue, all rows in one lockstep batch: each row's prompt and generated
    tokens, with the rows they were fed at, equal ``get_rope_index`` over the whole sequence
    (so a generated token at index i sits at i + rope delta in all three rows)."""
    adapter, _ = _model(model_type)
    model = adapter.load_model()  # the stop token not favoured: every answer runs to max_new_tokens
    first = [Dialogue(d.id, d.source, d.turns[:2]) for d in dialogues[:5]]
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=6, batch_size=len(first),
                                                             batch_schedule="lockstep"))
    record = _Positions(model, len(first))
    try:
        records = gen.generate(first)
    finally:
        record.handle.remove()
    assert all(r.new_tokens == 6 for r in records)
    inner = model.model
    for b, dialogue in enumerate(first):
        ids = torch.tensor([record.tokens[b]])
        grid = torch.tensor([adapter.image_grid(img) for img in dialogue.turns[0].images], dtype=torch.long)
        expected, _ = inner.get_rope_index(ids, mm_token_type_ids=(ids == adapter.image_token_id).int(),
                                           image_grid_thw=grid.reshape(-1, 3) if len(grid) else None)
        assert torch.equal(torch.cat(record.positions[b], dim=1), expected[:, 0]), dialogue.id


def test_first_turns_equal_transformers_generate(dialogues):
    adapter, model = _model("qwen2_5_vl")
    first = [Dialogue(d.id, d.source, d.turns[:2]) for d in dialogues]
    records, _ = _run(adapter, model, first, batch_size=4)
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=8))
    banned = sorted((set(adapter.tokenizer.all_special_ids) | {adapter.image_token_id}) - set(adapter.stop_token_ids))
    for dialogue, record in zip(first, records):
        ids, images, _ = gen._encode(Dialogue(dialogue.id, dialogue.source, dialogue.turns[:1]))
        x = torch.tensor([ids])
        inputs = adapter.image_inputs([img.path for img in images]) if images else {}
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                 mm_token_type_ids=(x == adapter.image_token_id).int(), **inputs, max_new_tokens=8,
                                 do_sample=False, suppress_tokens=banned, eos_token_id=adapter.stop_token_ids,
                                 pad_token_id=adapter.stop_token_ids[0])
        answer = [t for t in out[0, len(ids):].tolist() if t not in adapter.stop_token_ids]
        assert gen._answer_text(answer) == record.answer, dialogue.id

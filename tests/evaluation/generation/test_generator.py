import pytest
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator, read_generations
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.fixture(scope="module")
def tiny():
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0)
    return adapter, model


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    paths = []
    for i, colour in enumerate(["red", "green", "blue", "yellow", "purple"]):
        path = root / f"{i}.png"
        PILImage.new("RGB", (40 + 4 * i, 30), colour).save(path)
        paths.append(str(path))

    def make(k):
        turns = []
        for t in range(4):
            segments = (f"Image{t + 1}: ", Image(paths[(k + t) % 5]), f". What colour is Image{t + 1}?") if t < 3 else ("Compare Image1 and Image3.",)
            turns += [Turn("user", segments), Turn("assistant", (f"ref {k}-{t}",))]
        return Dialogue(f"d{k}", "test", tuple(turns))

    return [make(k) for k in range(3)]


def _answers(records):
    return [(r.dialogue_id, r.turn, r.answer) for r in records]


def test_kv_reuse_answers_identical_to_reencode_and_cheaper(tiny, dialogues):
    adapter, model = tiny
    kv = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=10, kv_reuse=True))
    re = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=10, kv_reuse=False))
    kv_records, re_records = kv.generate(dialogues), re.generate(dialogues)
    assert _answers(kv_records) == _answers(re_records)
    assert all(r.answer for r in kv_records)
    assert [r.prompt_tokens for r in kv_records] == [r.prompt_tokens for r in re_records]
    # re-encoding runs every prompt again; the KV path only the new part of each prompt
    assert kv.stats["forward_tokens"] < 0.6 * re.stats["forward_tokens"]
    # the history holds the model's own answers, not the references
    assert all("ref " not in (r.answer or "") for r in kv_records)


def test_batched_reencode_matches_one_by_one(tiny, dialogues):
    adapter, model = tiny
    one = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=8, kv_reuse=False, batch_size=1)).generate(dialogues)
    three = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=8, kv_reuse=False, batch_size=3)).generate(dialogues)
    assert _answers(one) == _answers(three)


def test_history_uses_own_answers(tiny, dialogues, monkeypatch):
    adapter, model = tiny
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=6))
    seen = []
    original = gen._encode
    monkeypatch.setattr(gen, "_encode", lambda d: (seen.append(d), original(d))[1])
    records = gen.generate(dialogues[:1])
    last = seen[-1]
    assistant_texts = [t.text for t in last.turns if t.role == "assistant"]
    assert assistant_texts == [r.answer for r in records[:-1]]
    assert len([s for t in last.turns for s in t.segments if isinstance(s, Image)]) == 3


def test_overflow_drop_oldest_keeps_named_images_and_records_it(tiny, dialogues):
    adapter, model = tiny
    full = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=4)).generate(dialogues[:1])
    window = full[2].prompt_tokens + 4 + 2  # turn 2 fits; turn 3 does not with all history
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=4, context_length=window, min_new_tokens=4))
    records = gen.generate(dialogues[:1])
    assert [r.context for r in records[:3]] == [None, None, None]
    last = records[3]
    assert last.context["policy"] == "drop_oldest" and last.context["dropped_exchanges"] >= 1
    # the last question names Image1 and Image3: Image1's dropped turn is carried
    assert last.context["carried_images"] >= 1
    assert last.prompt_tokens + 4 <= window and last.answer is not None


def test_overflow_stop_policy(tiny, dialogues):
    adapter, model = tiny
    full = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=4)).generate(dialogues[:1])
    window = full[1].prompt_tokens + 5
    records = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=4, context_length=window, overflow="stop", min_new_tokens=4)).generate(dialogues[:1])
    assert [r.finish_reason == "context" for r in records] == [False, False, True, True]
    assert records[2].answer is None and records[2].context["stopped"]


def test_jsonl_resume_continues_where_it_stopped(tiny, dialogues, tmp_path):
    adapter, model = tiny
    cfg = GenerationConfig(max_new_tokens=6)
    reference = DialogueGenerator(adapter, model, cfg).generate(dialogues)
    out = tmp_path / "gen.jsonl"
    DialogueGenerator(adapter, model, cfg).generate(dialogues, out_path=out)
    lines = out.read_text().splitlines()
    # simulate a crash: 5 turns written, the 6th torn mid-line
    out.write_text("\n".join(lines[:5]) + "\n" + lines[5][: len(lines[5]) // 2])
    resumed = DialogueGenerator(adapter, model, cfg)
    records = resumed.generate(dialogues, out_path=out)
    assert resumed.stats["turns"] == len(lines) - 5
    assert _answers(records) == _answers(reference)
    on_disk = read_generations(out)
    assert len(on_disk) == len(lines) and sorted((r["dialogue_id"], r["turn"]) for r in on_disk) == sorted((r.dialogue_id, r.turn) for r in reference)
    with pytest.raises(ValueError, match="other settings"):
        DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=7)).generate(dialogues, out_path=out)


def test_kv_reuse_matches_reencode_for_internlm_xcomposer2(dialogues):
    """The generator relies only on the adapter contract: XComposer2 (Partial LoRA on image tokens) works too."""
    from pathlib import Path

    from omegaconf import OmegaConf

    yaml = Path(__file__).resolve().parents[3] / "configs" / "model" / "internlm_xc2_tiny.yaml"
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(yaml)))
    adapter = build_adapter(cfg)
    model = adapter.load_model()
    kv = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=6)).generate(dialogues[:2])
    re = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=6, kv_reuse=False, batch_size=2)).generate(dialogues[:2])
    assert _answers(kv) == _answers(re) and all(r.answer is not None for r in kv)

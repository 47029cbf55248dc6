"""Batched generation with dynamic RoPE scaling: past the original window transformers rescales
the rotary frequencies from the largest position of the whole batch, so rows would change each
other's logits. The generator then runs one dialogue at a time and says so (log and results
meta); within the window it keeps batching.

A tiny LLaVA extended with ``context.rope_scaling=dynamic`` from a 48-token window, as a
Table 5 run extends LLaVA-1.5: its prompts run past 48 tokens.
"""

import logging

import pytest
import torch
from PIL import Image as PILImage

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.config import EvalConfig
from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.generator import DialogueGenerator
from mmtune.evaluation.results import read_result
from mmtune.evaluation.runner import evaluate_model
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from mmtune.models.rope import ContextConfig, apply_context_extension

ORIGINAL = 48


@pytest.fixture(scope="module")
def dynamic():
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0).eval()
    extension = apply_context_extension(model, adapter.text_config(model.config),
                                        ContextConfig(max_length=4 * ORIGINAL, rope_scaling="dynamic"),
                                        model_max_position_embeddings=ORIGINAL)
    assert extension.rope_type == "dynamic" and extension.rotary_modules_rebuilt >= 1
    return adapter, model


@pytest.fixture(scope="module")
def dialogues(tmp_path_factory):
    root = tmp_path_factory.mktemp("dyn")
    out = []
    for k, words in enumerate([1, 6, 14, 3]):
        path = root / f"{k}.png"
        PILImage.effect_noise((40 + 9 * k, 36), 40).convert("RGB").save(path)
        question = " ".join(["Describe", "the", "image"] + ["please"] * words)
        out.append(Dialogue(f"d{k}", "t", (Turn("user", (Image(str(path)), question)), Turn("assistant", ("x",)),
                                          Turn("user", ("And now?",)), Turn("assistant", ("y",)))))
    return out


def _rows_depend_on_each_other(adapter, model, prompts):
    """Row 0's last logits alone and next to longer rows (right-padded, masked)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        alone = model(input_ids=ids[:1, : len(prompts[0])]).logits[0, -1]
        together = model(input_ids=ids, attention_mask=mask).logits[0, len(prompts[0]) - 1]
    return (alone - together).abs().max().item()


def test_past_the_window_rows_would_interfere_so_the_generator_runs_batch_1(dynamic, dialogues, caplog):
    adapter, model = dynamic
    cfg = GenerationConfig(max_new_tokens=6, min_new_tokens=6, context_length=4 * ORIGINAL, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="mmtune.evaluation.generation.generator"):
        gen = DialogueGenerator(adapter, model, cfg)
    assert gen.batch_size == 1
    assert "rope_type dynamic" in gen.batch_note and f"{ORIGINAL}-token window" in gen.batch_note
    assert any("batch_size=4 runs as 1" in r.getMessage() for r in caplog.records)
    # the reason is real: past the window a row's logits depend on the rows beside it
    prompts = [gen._encode(Dialogue(d.id, d.source, d.turns[:1]))[0] for d in dialogues]
    assert all(len(p) > ORIGINAL for p in prompts)
    shortest_first = sorted(prompts, key=len)
    assert _rows_depend_on_each_other(adapter, model, shortest_first) > 1e-4
    # and batch 1 is what runs: the same records as asking for batch 1
    records = gen.generate(dialogues)
    one = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=6, min_new_tokens=6,
                                                             context_length=4 * ORIGINAL, batch_size=1))
    assert one.batch_note is None  # nothing was lowered
    assert [(r.dialogue_id, r.turn, r.answer) for r in records] == [
        (r.dialogue_id, r.turn, r.answer) for r in one.generate(dialogues)]
    assert all(r.prompt_tokens > ORIGINAL and r.answer is not None for r in records)


def test_within_the_window_rows_are_independent_and_batched(dynamic):
    adapter, model = dynamic
    gen = DialogueGenerator(adapter, model, GenerationConfig(max_new_tokens=6, context_length=ORIGINAL, batch_size=4))
    assert gen.batch_size == 4 and gen.batch_note is None
    prompts = [[5 + k for k in range(n)] for n in (20, 30, 44)]  # every position inside the window
    assert _rows_depend_on_each_other(adapter, model, prompts) < 1e-5


def test_the_results_meta_says_which_batch_size_ran(dynamic, tmp_path):
    adapter, model = dynamic
    data = generate_synthetic(tmp_path / "syn", n_train=0, n_test=2, n_llava=0, image_size=56, max_turns=2)
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False,
                     generation=GenerationConfig(max_new_tokens=4, context_length=4 * ORIGINAL, batch_size=4))
    cfg.synthetic.data_path = str(data.test_json)
    cfg.synthetic.image_root = str(data.image_dir)
    evaluate_model(model, adapter, cfg, output_dir=str(tmp_path / "eval"), run_name="dynamic")
    meta = read_result(tmp_path / "eval" / f"synthetic-ctx{4 * ORIGINAL}.json").meta
    assert meta["generation"]["batch_size"] == 4 and meta["generation_batch_size"] == 1
    assert "rope_type dynamic" in meta["generation_batch_note"]

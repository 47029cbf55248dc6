"""The embedded default: `mmtune demo` trains a small LLaVA on multi-image dialogues from below chance to its target held-out exact match."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_reaches_target_from_chance(tmp_path):
    from mmtune.data.synthetic import chance_exact_match
    from mmtune.training.demo import TARGET

    out = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "mmtune.cli", "demo", f"training.output_dir={out}",
                           "logging.progress_bar=false"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    test = json.loads((out / "data" / "test.json").read_text())
    assert all(len(record["image"]) >= 2 for record in test)  # every dialogue is multi-image
    before = json.loads((out / "eval" / "before" / "synthetic.json").read_text())["metrics"]["exact_match"]
    after = json.loads((out / "eval" / "after" / "synthetic.json").read_text())["metrics"]["exact_match"]
    assert before <= chance_exact_match(out / "data" / "test.json") and after >= TARGET, (before, after)
    for line in ("task:", "model:", "chance level", "held-out exact match before training", "held-out exact match after training",
                 "same color", "viewer.html", "CPU threads:"):  # "same color": the per-question line
        assert line in proc.stdout, line
    assert (out / "final" / "model.safetensors").is_file() and (out / "eval" / "after" / "viewer.html").is_file()


def test_demo_picks_the_default_or_a_named_demo_experiment():
    from mmtune.training.demo import compose_sft_config, demo_overrides

    assert demo_overrides(["training.epochs=1"]) == ["experiment=demo", "training.epochs=1"]
    cfg = compose_sft_config(demo_overrides([]))
    # The default demo: several images in every dialogue, questions naming or comparing them.
    assert cfg.synthetic.options.min_images >= 2 and cfg.synthetic.options.max_turns >= 3
    assert set(cfg.synthetic.options.question_kinds) >= {"color", "same_color"}
    single = compose_sft_config(demo_overrides(["experiment=demo_single_image"]))
    assert single.synthetic.options.max_images == 1 and single.model.architecture.text_config.hidden_size == 64


def test_demo_states_its_task():
    from mmtune.training.demo import compose_sft_config, describe_task

    text = describe_task(dict(compose_sft_config(["experiment=demo"]).synthetic.options))
    assert text.startswith("2 image(s) per dialogue") and "named image" in text and "Do Image1 and Image2 have the same color?" in text
    assert "all shown in the first message" in text and "never the same question twice" in text


def test_demo_states_its_model_and_what_trains():
    from mmtune.training.demo import compose_sft_config, describe_model

    text = describe_model(compose_sft_config(["experiment=demo"]))
    assert text.startswith("4-layer, 128-wide random Llama (init std 0.06)")
    assert "trained: projector, language model; frozen: vision" in text and "3 epochs of 4000 dialogues" in text

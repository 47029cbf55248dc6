"""The embedded default: `mmtune demo` trains the tiny LLaVA from chance to >= 90% held-out exact match."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_demo_reaches_target_from_chance(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "mmtune.cli", "demo", f"training.output_dir={out}",
                           "logging.progress_bar=false"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = json.loads((out / "eval" / "before" / "synthetic.json").read_text())["metrics"]["exact_match"]
    after = json.loads((out / "eval" / "after" / "synthetic.json").read_text())["metrics"]["exact_match"]
    assert before < 60.0 and after >= 90.0, (before, after)
    assert "held-out exact match after training" in proc.stdout
    assert (out / "final" / "model.safetensors").is_file()


def test_demo_picks_the_default_or_a_named_demo_experiment():
    from mmtune.training.demo import compose_sft_config, demo_overrides

    assert demo_overrides(["training.epochs=1"]) == ["experiment=demo", "training.epochs=1"]
    cfg = compose_sft_config(demo_overrides(["experiment=demo_multi_image"]))
    # The multi-image demo: two images in every dialogue, the bigger demo model.
    assert cfg.synthetic.options.min_images == cfg.synthetic.options.max_images == 2
    assert cfg.model.architecture.text_config.hidden_size == 256

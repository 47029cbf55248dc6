"""The tiny InternLM-XComposer2 goes through the same SFT recipe (LoRA on top of Partial
LoRA, packed batches, in-training evaluation) and the same evaluation recipe as LLaVA."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(script: str, overrides: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / script), *overrides], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow  # two recipe processes; the default suite trains the tiny XComposer2 in tests/training
def test_xcomposer2_trains_with_sft_recipe_and_evaluates_with_evaluate_recipe(tmp_path):
    from mmtune.data.synthetic import generate_synthetic

    data = generate_synthetic(tmp_path / "data", n_train=16, n_test=2, n_llava=0, seed=0, image_size=56,
                              min_images=2, max_images=3, max_turns=2)
    out = tmp_path / "run"
    _run("sft.py", [
        "experiment=demo_single_image", "model=internlm_xc2_tiny", "peft=lora", "collator.batching=packing",
        f"training.output_dir={out}", f"synthetic.out_dir={tmp_path / 'data'}",
        "training.max_steps=2", "training.eval_before=false", "training.eval_after=true",
        f"eval.synthetic.data_path={data.test_json}", f"eval.synthetic.image_root={data.image_dir}",
        "eval.generation.max_new_tokens=3", "logging.progress_bar=false", "collator.batch_size=4",
    ])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["train/loss"] > 0 for m in metrics)
    run = json.loads((out / "final" / "mmtune_run.json").read_text())
    assert run["family"] == "internlm_xcomposer2"
    in_training = json.loads(next((out / "eval").rglob("synthetic.json")).read_text())
    assert in_training["counts"]["missing"] == 0 and 0.0 <= in_training["metrics"]["exact_match"] <= 100.0

    # The saved checkpoint evaluates through recipes/evaluate.py like any other.
    eval_out = tmp_path / "eval"
    proc = _run("evaluate.py", [
        f"checkpoint={out / 'final'}", f"output_dir={eval_out}", "run_name=xc2",
        f"eval.synthetic.data_path={data.test_json}", f"eval.synthetic.image_root={data.image_dir}",
        "eval.generation.max_new_tokens=3", "eval.progress=false",
    ])
    result = json.loads((eval_out / "synthetic.json").read_text())
    assert result["run"] == "xc2" and result["counts"]["missing"] == 0
    assert result["metrics"]["exact_match"] == in_training["metrics"]["exact_match"]
    assert "synthetic:" in proc.stdout

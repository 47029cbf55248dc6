"""CPU smoke test of recipes/sft.py: a short run with an 8k RoPE-extended window writes a
loadable final checkpoint, metrics and run metadata."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def test_sft_recipe_runs_and_writes_a_loadable_checkpoint(tmp_path):
    from mmtune.data.synthetic import generate_synthetic
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    data = tmp_path / "data"
    generate_synthetic(data, n_train=16, n_test=2, n_llava=0, seed=0, image_size=56)
    out = tmp_path / "run"
    overrides = [
        "experiment=demo_single_image", f"training.output_dir={out}", f"synthetic.out_dir={data}",
        "training.max_steps=3", "training.eval_before=false", "training.eval_after=false",
        "logging.progress_bar=false", "collator.batch_size=4",
        "context=8k", "model.architecture.text_config.max_position_embeddings=4096",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sft.py"), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/loss"] > 0 and m["train/loss_tokens"] > 0 for m in metrics)
    run = json.loads((out / "final" / "mmtune_run.json").read_text())
    assert run["family"] == "llava" and run["step"] == 3
    assert run["context_extension"] == {"original": 4096, "target": 8192, "rope_type": "linear", "factor": 2.0,
                                        "rotary_modules_rebuilt": 1}
    assert run["config"]["training"]["output_dir"] == str(out)

    # final/ loads through the adapter, with the 8k linear RoPE in its rotary module.
    adapter = build_adapter(ModelConfig(family="llava", path=str(out / "final")))
    model = adapter.load_model()
    text = model.config.text_config
    assert text.rope_parameters["rope_type"] == "linear" and text.rope_parameters["factor"] == 2.0
    assert text.max_position_embeddings == 8192 and adapter.tokenizer.model_max_length == 8192
    fresh = build_adapter(ModelConfig(family="llava")).load_model()
    torch.testing.assert_close(model.model.language_model.rotary_emb.inv_freq,
                               fresh.model.language_model.rotary_emb.inv_freq / 2.0)


def _recipe(tmp_path, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        env.pop(name, None)
    return subprocess.run([sys.executable, str(REPO / "recipes" / "sft.py"), "experiment=demo_single_image",
                           f"synthetic.out_dir={tmp_path / 'data'}", "synthetic.n_train=8", "synthetic.n_test=2",
                           "training.eval_before=false", "training.eval_after=false", *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


# one recipe process each: the default suite starts the first, the others run with the slow tests
@pytest.mark.parametrize("case", ["invalid-value", pytest.param("used-output-dir", marks=pytest.mark.slow),
                                  pytest.param("fsdp2-without-ranks", marks=pytest.mark.slow)])
def test_expected_refusals_are_one_message_not_a_hydra_traceback(tmp_path, case):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')  # an earlier run's
    overrides, message = {
        "invalid-value": (("training.max_nonfinite_steps=-1",),
                          "recipes/sft.py: invalid SFT config:\n  - training.max_nonfinite_steps=-1 must be >= 0"),
        "used-output-dir": ((f"training.output_dir={out}", "training.resume=null"),
                            f"recipes/sft.py: {out} holds an earlier run (metrics.jsonl)"),
        "fsdp2-without-ranks": ((f"training.output_dir={tmp_path / 'other'}", "training.backend.engine=fsdp2"),
                                "recipes/sft.py: training.backend.engine=fsdp2 shards the model over a process group"),
    }[case]
    proc = _recipe(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert proc.stderr.count("recipes/sft.py: ") == 1

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from mmtune.evaluation.config import EvaluateConfig, register_configs, to_evaluate_config

ROOT = Path(__file__).resolve().parents[2]
EVAL_CONFIGS = sorted(p.stem for p in (ROOT / "configs" / "eval").glob("*.yaml"))


@pytest.mark.parametrize("name", EVAL_CONFIGS)
def test_every_eval_config_composes_into_the_schema(name):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("evaluate", overrides=[f"eval={name}", "eval.synthetic.data_path=x.json",
                                             "eval.heldout.data_path=x.json"])
    config = to_evaluate_config(cfg)
    assert isinstance(config, EvaluateConfig) and config.eval.benchmarks


def test_unknown_key_fails_at_start_up():
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        with pytest.raises(Exception, match="max_new_tokenz"):
            compose("evaluate", overrides=["eval.generation.max_new_tokenz=3"])
        # a typo inside a YAML file is caught when the config is converted to the schema
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"eval": {"generation": {"max_new_tokenz": 3}}})
    with pytest.raises(Exception, match="max_new_tokenz"):
            to_evaluate_config(cfg)


def test_recipe_runs_synthetic_on_tiny_model(tmp_path):
    from mmtune.data.synthetic import generate_synthetic

    data = generate_synthetic(tmp_path / "data", n_train=0, n_test=2, n_llava=0, image_size=56, max_turns=2)
    out = tmp_path / "eval"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "evaluate.py"), f"output_dir={out}", "run_name=smoke",
         f"eval.synthetic.data_path={data.test_json}", f"eval.synthetic.image_root={data.image_dir}",
         "eval.generation.max_new_tokens=4", "eval.progress=false"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "synthetic.json").read_text())
    assert result["run"] == "smoke" and result["model"] == "random:llava" and result["counts"]["missing"] == 0
    assert "synthetic:" in proc.stdout and (out / "report.md").exists()


@pytest.mark.slow  # one recipe process; the default suite starts the SFT recipe's refusal (tests/recipes/test_sft.py)
def test_an_expected_refusal_is_one_message_not_a_hydra_traceback(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "evaluate.py"), f"output_dir={tmp_path / 'eval'}",
         f"eval.synthetic.data_path={tmp_path / 'absent.json'}", "eval.progress=false"],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("recipes/evaluate.py: ") and str(tmp_path / "absent.json") in proc.stderr
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr

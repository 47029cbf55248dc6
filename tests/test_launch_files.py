"""Every accelerate config under launch/ loads with accelerate's own parser and points at a
DeepSpeed JSON that exists, parses, and leaves the run's values to accelerate ("auto")."""

import json
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import ClusterConfig

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = sorted((REPO / "launch" / "accelerate").glob("*.yaml"))
DEEPSPEED_CONFIGS = sorted((REPO / "launch" / "deepspeed").glob("*.json"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads(path):
    config = ClusterConfig.from_yaml_file(str(path))
    if config.distributed_type == "DEEPSPEED":
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        assert ds_file.is_file(), f"{path.name} names a missing {ds_file}"
        stage = json.loads(ds_file.read_text())["zero_optimization"]["stage"]
        # ZeRO-3 init only makes sense with a stage-3 JSON.
        assert bool(config.deepspeed_config.get("zero3_init_flag")) == (stage == 3), path.name
        if config.num_machines > 1:
            assert config.deepspeed_config.get("deepspeed_multinode_launcher") == "standard"


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=lambda p: p.name)
def test_deepspeed_config_leaves_run_values_to_accelerate(path):
    ds = json.loads(path.read_text())
    # One source for each value: the experiment config, filled in by accelerate.
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        assert ds.get(key) == "auto", f"{path.name}: {key} should be 'auto'"
    assert ds["zero_optimization"]["stage"] in (2, 3)

"""The training side of ``mmtune data check``: the window a run's overrides compose to."""

import pytest

from mmtune.training.config import ConfigError
from mmtune.training.data_window import training_window


def test_no_model_no_window_and_the_32k_experiment_composes_as_training_does():
    assert training_window(["collator.max_length=64"]) is None
    window = training_window(["experiment=mmdu45k_qwen2_5_vl_7b_32k"])
    cfg = window.config
    assert (cfg.model.family, cfg.collator.max_length, cfg.collator.truncation) == ("qwen2_vl", 32768, "skip_sample")
    assert cfg.training.sequence_parallel.size == 4 and window.image_limits is cfg.model.image_limits
    tiny = training_window(["model=llava_tiny", "training.sequence_parallel.size=2"]).config
    assert tiny.model.family == "llava" and tiny.training.sequence_parallel.size == 2
    # a config training would refuse is refused here, by its key
    with pytest.raises(ConfigError, match="training.sequence_parallel.size=2 with training.backend.engine=deepspeed"):
        training_window(["model=llava_tiny", "training.sequence_parallel.size=2", "training.backend.engine=deepspeed"])

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


def test_the_32k_experiment_with_the_tiny_qwen2_vl_measures_every_dialogue(tmp_path):
    """The experiment's window settings (SP=4, skip_sample) with the tiny Qwen2-VL (M-RoPE, its own
    image token counts) and a row of 1024: each dialogue measured as the dataset encodes it."""
    import json

    from PIL import Image as PILImage

    from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
    from mmtune.data.encoding import encode_example
    from mmtune.data.mixture import build_mixture

    PILImage.new("RGB", (56, 56), "red").save(tmp_path / "red.jpg")
    records = [{"id": f"d{k}", "image": ["red.jpg"],
                "conversations": [{"from": "user", "value": "<ImageHere> q " + "word " * w},
                                  {"from": "assistant", "value": "a " + "word " * w}]} for k, w in enumerate([10, 900])]
    (tmp_path / "chat.json").write_text(json.dumps(records))
    data = DataConfig(mixture=MixtureConfig(sources=[SourceConfig(name="chat", format="mmdu",
                                                                  path=str(tmp_path / "chat.json"))]),
                      cache_dir=str(tmp_path / "cache"))
    mixture = build_mixture(data)
    window = training_window(["experiment=mmdu45k_qwen2_5_vl_7b_32k", "model=qwen2_vl_tiny",
                              "collator.max_length=1024"])
    report = window.measure(data, mixture)
    from mmtune.models.registry import build_adapter

    adapter = build_adapter(window.config.model)
    full = [len(encode_example(adapter, d, max_length=None).input_ids) for d in mixture.sources[0].dialogues]
    assert full[0] <= 256 < 1024 < full[1]
    assert (report.sequence_parallel, report.per_gpu, report.truncation) == (4, 256, "skip_sample")
    assert report.over_gpu == 1 and [(d.dialogue_id, d.length, d.kept) for d in report.over_row] == [("d1", full[1], 0)]

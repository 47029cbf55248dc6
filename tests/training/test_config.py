"""Values that could only fail later (NaN learning rate, negative decay, ...) are refused at start-up, all at once."""

import pytest

from mmtune.training.config import ConfigError, to_sft_config, validate
from mmtune.training.demo import compose_sft_config

# (override key, bad value as typed on the command line); each must be refused by its key.
BAD = [
    *[("training.lr", v) for v in ("nan", "inf", "-inf", "0", "-1e-4")],
    *[("training.projector.lr", v) for v in ("nan", "inf", "0")],
    *[("training.weight_decay", v) for v in ("nan", "inf", "-0.1")],
    *[("training.language_model.weight_decay", v) for v in ("nan", "-1")],
    *[("training.adam_beta1", v) for v in ("nan", "1.0", "-0.1")],
    *[("training.adam_beta2", v) for v in ("nan", "1.5")],
    *[("training.adam_epsilon", v) for v in ("nan", "inf", "0", "-1e-8")],
    *[("training.max_grad_norm", v) for v in ("nan", "-1")],
    *[("training.warmup_ratio", v) for v in ("nan", "1.0", "-0.1")],
    ("training.max_steps", "0"), ("training.warmup_steps", "-1"), ("training.num_workers", "-1"),
    *[("peft.alpha", v) for v in ("0", "-16")],
    *[("peft.dropout", v) for v in ("nan", "1.0")],
    *[("context.yarn_beta_fast", v) for v in ("nan", "0")],
    ("context.original_max_position_embeddings", "0"),
    ("collator.pad_to_multiple_of", "0"),
    ("data.validation.max_examples", "-1"),
]
# Boundary values that mean something and must stay accepted.
GOOD = [("training.weight_decay", "0"), ("training.max_grad_norm", "0"), ("training.max_grad_norm", "inf"),
        ("training.max_grad_norm", "null"), ("training.warmup_ratio", "0"), ("training.adam_beta1", "0"),
        ("training.warmup_steps", "0"), ("training.num_workers", "0"), ("peft.alpha", "1"),
        ("data.validation.max_examples", "0")]


def _config(tmp_path, *overrides):
    base = ["experiment=demo_single_image", f"training.output_dir={tmp_path}", "peft.method=lora"]
    return to_sft_config(compose_sft_config([*base, *overrides]))


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_a_value_that_can_only_fail_later_is_refused_by_its_key(tmp_path, key, value):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, f"{key}={value}")
    assert key in str(info.value)


@pytest.mark.parametrize("key,value", GOOD, ids=[f"{k}={v}" for k, v in GOOD])
def test_boundary_values_with_a_meaning_are_accepted(tmp_path, key, value):
    _config(tmp_path, f"{key}={value}")


def test_every_bad_value_is_listed_in_one_error(tmp_path):
    one_each = {key: value for key, value in BAD}  # the last bad value of every key
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, *(f"{k}={v}" for k, v in one_each.items()))
    message = str(info.value)
    missing = [key for key in one_each if key not in message]
    assert not missing, message


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -1.0])
def test_a_mixture_weight_must_be_a_finite_share(tmp_path, weight):
    cfg = _config(tmp_path)
    cfg.data.mixture.weights = {"synthetic_mmdu": weight}
    with pytest.raises(ConfigError, match=rf"data\.mixture\.weights\.synthetic_mmdu={weight}"):
        validate(cfg)
    cfg.data.mixture.weights = {"synthetic_mmdu": 0.5}
    validate(cfg)


def test_sequence_parallelism_under_deepspeed_is_refused_saying_what_is_unverified_and_what_to_use(tmp_path):
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, "training.sequence_parallel.size=2", "training.backend.engine=deepspeed")
    message = str(info.value)
    assert "training.sequence_parallel.size=2 with training.backend.engine=deepspeed is refused" in message
    assert "never run" in message and "deepspeed.comm" in message and "gloo" in message and "ddp and fsdp2 on 2 and 4 ranks" in message
    assert "ZeRO-3 gathering the vision tower's weights" in message and "all-to-all" in message
    assert "Use training.backend.engine=ddp or fsdp2, or training.sequence_parallel.size=1" in message
    for engine in ("ddp", "fsdp2"):
        assert _config(tmp_path, "training.sequence_parallel.size=2",
                       f"training.backend.engine={engine}").training.sequence_parallel.size == 2

"""Judge and generation settings that could only fail mid-evaluation are refused at start-up, all at once."""

import pytest

from mmtune.evaluation.config import EvalConfig, validate_eval_config

NAN, INF = float("nan"), float("inf")
# (group, field, bad value); each must be refused naming eval.<group>.<field>.
BAD = [
    *[("judge", "timeout_s", v) for v in (NAN, INF, 0.0, -1.0)],
    ("judge", "max_retries", -1),
    *[("judge", "backoff_base_s", v) for v in (NAN, INF, -1.0)],
    *[("judge", "backoff_max_s", v) for v in (NAN, -0.5)],
    ("judge", "stop_after_failures", 0),
    ("judge", "max_tokens", 0),
    *[("judge", "max_reply_mb", v) for v in (NAN, INF, 0.0, -1.0)],
    ("judge", "concurrency", 0),
    *[("judge", "max_failed_share", v) for v in (NAN, 1.5)],
    *[("generation", "repetition_penalty", v) for v in (NAN, 0.0, -1.0)],
    ("generation", "min_new_tokens", -1),
    ("generation", "context_length", 0),
    ("generation", "max_new_tokens", 0),
    *[(group, "limit", v) for group in ("mmdu", "mmvet", "mdi", "synthetic") for v in (0, -1)],
    ("mmvet", "max_tries", 0),
]
# Sampling settings matter only when sampling.
SAMPLING_BAD = [("temperature", v) for v in (NAN, INF, 0.0, -1.0)] + [("top_p", v) for v in (NAN, 0.0, 1.5)]


def _config(**changes) -> EvalConfig:
    cfg = EvalConfig(benchmarks=[])
    for dotted, value in changes.items():
        group, name = dotted.split("__")
        setattr(getattr(cfg, group), name, value)
    return cfg


@pytest.mark.parametrize("group,name,value", BAD, ids=[f"{g}.{n}={v}" for g, n, v in BAD])
def test_a_value_that_can_only_fail_later_is_refused_by_its_key(group, name, value):
    with pytest.raises(ValueError, match=rf"eval\.{group}\.{name}="):
        validate_eval_config(_config(**{f"{group}__{name}": value}))


@pytest.mark.parametrize("name,value", SAMPLING_BAD, ids=[f"{n}={v}" for n, v in SAMPLING_BAD])
def test_sampling_settings_are_checked_when_sampling(name, value):
    validate_eval_config(_config(**{f"generation__{name}": value}))  # greedy: ignored, as transformers does
    with pytest.raises(ValueError, match=rf"eval\.generation\.{name}=.*do_sample"):
        validate_eval_config(_config(generation__do_sample=True, **{f"generation__{name}": value}))


def test_batch_sizes_by_model_size_must_be_positive():
    with pytest.raises(ValueError, match=r"eval\.generation\.batch_size_by_size\.9B=0"):
        validate_eval_config(_config(generation__batch_size_by_size={"3B": 4, "9B": 0}))


def test_boundary_values_with_a_meaning_are_accepted():
    validate_eval_config(_config(judge__max_retries=0, judge__backoff_base_s=0.0, judge__backoff_max_s=0.0,
                                 judge__max_failed_share=1.0, generation__min_new_tokens=0,
                                 judge__timeout_s=0.5, mmdu__limit=1, mmvet__max_tries=1))
    validate_eval_config(_config(generation__do_sample=True, generation__top_p=1.0, generation__temperature=0.01))


def test_every_bad_value_is_listed_in_one_error():
    one_each = {(g, n): v for g, n, v in BAD}
    cfg = _config(**{f"{g}__{n}": v for (g, n), v in one_each.items()})
    with pytest.raises(ValueError) as info:
        validate_eval_config(cfg)
    missing = [f"eval.{g}.{n}" for g, n in one_each if f"eval.{g}.{n}=" not in str(info.value)]
    assert not missing, str(info.value)

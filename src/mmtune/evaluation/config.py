"""Typed configs of the evaluator (the ``eval/`` Hydra group and ``configs/evaluate.yaml``).

Every field has a docstring; Hydra validates YAML against these dataclasses, so an
unknown key fails at start-up. Each room owns its section: decoding is
:class:`~mmtune.evaluation.generation.config.GenerationConfig` (``eval.generation``),
the judge :class:`~mmtune.evaluation.judge.config.JudgeConfig` (``eval.judge``), and
every benchmark its ``eval.<name>`` section, typed by the ``settings_class`` its module
declares. :class:`EvalConfig` holds them together; its benchmark sections are those of
the registered benchmarks, so a new benchmark brings its section without an edit here.
Secrets are not config: the judge's base URL and key are read from the environment
variables *named* in ``eval.judge``, never stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from mmtune.core.sections import Sectioned, with_sections
from mmtune.evaluation.generation.config import BACKENDS, ApiGenerationConfig, GenerationConfig
from mmtune.evaluation.judge.config import JudgeConfig
from mmtune.experiment import Recipe
from mmtune.models.config import ModelConfig

__all__ = [
    "GenerationConfig",
    "ApiGenerationConfig",
    "JudgeConfig",
    "EvalConfig",
    "EvaluateConfig",
    "eval_config_class",
    "default_output_dir",
    "validate_eval_config",
    "register_configs",
    "to_evaluate_config",
]


@dataclass
class EvalConfig(Sectioned):
    """The ``eval/`` group: which benchmarks, how to generate, how to judge, and one
    section per registered benchmark (``eval.mmdu``, ``eval.mmvet``, ...).

    The benchmark sections are not written out here: ``EvalConfig(...)`` returns an
    instance of :func:`eval_config_class`, this class extended by one field per
    registered benchmark (typed by its ``settings_class``). So Hydra, OmegaConf and
    Python code (``EvalConfig(benchmarks=["mdi"], mdi=MDIConfig(alpha=0.3))``) all see
    the sections of every benchmark registered when the config is built.
    """

    benchmarks: list[str] = field(default_factory=lambda: ["synthetic"])
    """Benchmarks to run, by registered name (built-in: lmms_eval, mdi, mmdu, mmvet, synthetic)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    allow_absolute_image_paths: bool = False
    """Accept absolute image paths outside a benchmark's ``image_root`` (default: the data
    file's folder). Off: such a path, or one escaping the root through ``..``/symlinks,
    fails loading with ``path_outside_root`` (see :mod:`mmtune.data.paths`)."""
    report: bool = True
    """Write ``report.md`` with tables and PNG plots next to the result JSONs."""
    progress: bool = True
    """Show progress bars for generation and judging."""

    @classmethod
    def sectioned_class(cls) -> type:
        return eval_config_class()


def eval_config_class() -> type:
    """:class:`EvalConfig` with one field per registered benchmark, named after it and typed
    by its ``settings_class`` (built once per set of registered benchmarks).

    Raises:
        ValueError: a benchmark's name is one of the common fields (``eval.judge`` ...).
    """
    from mmtune.evaluation.benchmarks.registry import settings_classes

    return with_sections(EvalConfig, settings_classes(),
                         clash="benchmark name(s) {names} collide with the eval config's own keys; rename the benchmark")


@dataclass
class EvaluateConfig:
    """Top-level schema of ``recipes/evaluate.py``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Model to evaluate when ``checkpoint`` is unset (``path`` = local HF model)."""
    checkpoint: Optional[str] = None
    """A directory mmtune saved (full, LoRA adapter or merged); its ``mmtune_run.json``
    supplies the model family. Overrides ``model.path``."""
    run_name: str = "eval"
    """Label written into every result file."""
    output_dir: Optional[str] = None
    """Where generations, judge cache, result JSONs and the report go. ``None``:
    ``outputs/eval/<run_name>/<model>`` with one folder per checkpoint / model path
    (:func:`default_output_dir`), so two models never share resumable answers."""
    wandb: bool = False
    """Log metrics and the report's plots to Weights & Biases."""
    wandb_project: str = "mmtune"
    """W&B project when ``wandb`` is on."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    recipe: Recipe = Recipe.evaluate
    """Which recipe runs this config: ``evaluate`` (recipes/evaluate.py, ``mmtune evaluate``) or
    ``sft`` (recipes/sft.py, ``mmtune train``). Training experiments set ``sft``, and
    ``mmtune evaluate`` refuses them, naming the command that runs them."""
    launcher: Optional[str] = None
    """The accelerate config file the experiment's command launches with (``accelerate launch
    --config_file <launcher>``), relative to the project; ``None``: one process (or ``--gpus``
    processes started by ``accelerate launch`` without a config file)."""


def default_output_dir(run_name: str, checkpoint: Optional[str], model: ModelConfig,
                       generation: Optional[GenerationConfig] = None) -> str:
    """``outputs/eval/<run_name>/<model>``: the checkpoint's (else ``model.path``'s) last
    two path parts and a hash of its absolute path, or ``random-<family>``; with
    ``generation.backend: api``, ``api-<served model>-<hash>``."""
    import hashlib
    import os
    import re

    target = checkpoint or model.path
    if generation is not None and generation.backend == "api" and generation.api.model:
        name = generation.api.model
        slug = "api-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + "-" + hashlib.sha1(name.encode()).hexdigest()[:8]
    elif not target:
        slug = f"random-{model.family}"
    else:
        absolute = os.path.abspath(target) if os.path.exists(target) else target
        tail = "-".join(p for p in absolute.replace("\\", "/").split("/")[-2:] if p)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", tail) + "-" + hashlib.sha1(absolute.encode()).hexdigest()[:8]
    return os.path.join("outputs", "eval", run_name, slug)


def _endpoint_problems(settings: Any, key: str) -> list[str]:
    """Problems of the call settings a chat endpoint reads (the judge's and the served
    model's alike: concurrency, timeout, retries, backoff), named under ``key``."""
    problems = []
    if settings.concurrency < 1:
        problems.append(f"{key}.concurrency={settings.concurrency}: must be >= 1")
    if not (math.isfinite(settings.timeout_s) and settings.timeout_s > 0):
        problems.append(f"{key}.timeout_s={settings.timeout_s}: must be a finite number of seconds > 0")
    if settings.max_retries < 0:
        problems.append(f"{key}.max_retries={settings.max_retries}: must be >= 0 (0: no retries)")
    for name in ("backoff_base_s", "backoff_max_s"):
        value = getattr(settings, name)
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{key}.{name}={value}: must be a finite number of seconds >= 0")
    cap = settings.max_reply_mb
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        problems.append(f"{key}.max_reply_mb={cap}: must be a finite number of MB > 0 (or null: from max_tokens)")
    return problems


def validate_eval_config(cfg: EvalConfig) -> None:
    """Collect every problem of ``cfg`` (and of each chosen benchmark's settings) and raise once."""
    import dataclasses

    from mmtune.evaluation.benchmarks.registry import get_benchmark, registered_names

    problems = []
    for name in cfg.benchmarks:
        try:
            problems += get_benchmark(name).check(cfg)
        except ValueError:
            problems.append(f"eval.benchmarks: unknown benchmark {name!r}; choose from {list(registered_names())}")
    gen = cfg.generation
    if gen.overflow not in ("drop_oldest", "stop"):
        problems.append(f"eval.generation.overflow={gen.overflow!r}: use 'drop_oldest' or 'stop'")
    if gen.max_new_tokens < 1:
        problems.append(f"eval.generation.max_new_tokens={gen.max_new_tokens}: must be >= 1")
    if gen.batch_schedule not in ("auto", "continuous", "lockstep"):
        problems.append(f"eval.generation.batch_schedule={gen.batch_schedule!r}: use auto, continuous or lockstep")
    if gen.batch_size is not None and gen.batch_size < 1:
        problems.append(f"eval.generation.batch_size={gen.batch_size}: must be >= 1")
    if gen.min_new_tokens < 0:
        problems.append(f"eval.generation.min_new_tokens={gen.min_new_tokens}: must be >= 0")
    if gen.context_length is not None and gen.context_length < 1:
        problems.append(f"eval.generation.context_length={gen.context_length}: must be >= 1 (or null: the model's)")
    for label, size in gen.batch_size_by_size.items():
        if not isinstance(size, int) or size < 1:
            problems.append(f"eval.generation.batch_size_by_size.{label}={size}: must be an integer >= 1")
    # NaN passes every comparison, so each bound is written as "not (x within range)".
    if not (math.isfinite(gen.repetition_penalty) and gen.repetition_penalty > 0):
        problems.append(f"eval.generation.repetition_penalty={gen.repetition_penalty}: must be a finite number > 0")
    if gen.do_sample:  # ignored when greedy, as transformers does
        if not (math.isfinite(gen.temperature) and gen.temperature > 0):
            problems.append(f"eval.generation.temperature={gen.temperature}: must be a finite number > 0 when "
                            "do_sample is true")
        if not 0.0 < gen.top_p <= 1.0:
            problems.append(f"eval.generation.top_p={gen.top_p}: must be within (0, 1] when do_sample is true")
    if gen.backend not in BACKENDS:
        problems.append(f"eval.generation.backend={gen.backend!r}: use {' or '.join(BACKENDS)}")
    api = gen.api
    if gen.backend == "api" and not api.model:
        problems.append("eval.generation.api.model is required with eval.generation.backend=api: the served model's "
                        "name as the endpoint knows it (e.g. gpt-4o-2024-05-13, or the model given to `vllm serve`)")
    problems += _endpoint_problems(api, "eval.generation.api")
    if not 0.0 <= api.max_failed_share <= 1.0:
        problems.append(f"eval.generation.api.max_failed_share={api.max_failed_share}: must be within [0, 1]")
    if api.max_image_side is not None and api.max_image_side < 1:
        problems.append(f"eval.generation.api.max_image_side={api.max_image_side}: must be >= 1 pixel (or null: no cap)")
    if not (math.isfinite(api.max_image_mb) and api.max_image_mb > 0):
        problems.append(f"eval.generation.api.max_image_mb={api.max_image_mb}: must be a finite number of MB > 0")
    if api.oversize not in ("downscale", "refuse"):
        problems.append(f"eval.generation.api.oversize={api.oversize!r}: use downscale or refuse")
    judge = cfg.judge
    for key in ("max_failed_share", "max_unparsed_share"):
        if not 0.0 <= getattr(judge, key) <= 1.0:  # NaN fails this too
            problems.append(f"eval.judge.{key}={getattr(judge, key)}: must be within [0, 1]")
    problems += _endpoint_problems(judge, "eval.judge")
    if judge.stop_after_failures < 1:
        problems.append(f"eval.judge.stop_after_failures={judge.stop_after_failures}: must be >= 1")
    if judge.max_tokens < 1:
        problems.append(f"eval.judge.max_tokens={judge.max_tokens}: must be >= 1")
    # Every benchmark's own group: a limit of 0 or -1 would silently score no item or drop
    # the last one (a slice), zero tries would score every item 0 without asking the judge.
    for group in dataclasses.fields(cfg):
        sub = getattr(cfg, group.name)
        for key, least, meaning in (("limit", 1, " (or null: every item)"), ("max_tries", 1, "")):
            value = getattr(sub, key, None)
            if value is not None and value < least:
                problems.append(f"eval.{group.name}.{key}={value}: must be >= {least}{meaning}")
    if problems:
        raise ValueError("invalid evaluation config:\n  - " + "\n  - ".join(problems))


def register_configs() -> None:
    """Register :class:`EvaluateConfig` as ``evaluate_schema`` for Hydra (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="evaluate_schema", node=EvaluateConfig)


def to_evaluate_config(cfg: Any) -> EvaluateConfig:
    """A composed Hydra/OmegaConf config as a validated :class:`EvaluateConfig`."""
    from omegaconf import OmegaConf

    from mmtune.schema_keys import unknown_keys

    unknown = unknown_keys(cfg, EvaluateConfig)
    if unknown:  # ``+key=value`` slips past OmegaConf's struct check; a typo must not be ignored
        raise ValueError("unknown config key(s), not in the schema (mmtune.evaluation.config.EvaluateConfig):\n  - "
                         + "\n  - ".join(unknown))
    merged = OmegaConf.merge(OmegaConf.structured(EvaluateConfig), cfg)
    config = OmegaConf.to_object(merged)
    validate_eval_config(config.eval)
    return config

"""Typed configs of the evaluator (the ``eval/`` Hydra group and ``configs/evaluate.yaml``).

Every field has a docstring; Hydra validates YAML against these dataclasses, so an
unknown key fails at start-up. Secrets are not config: the judge's base URL and key are
read from the environment variables *named* here, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mmtune.models.config import ModelConfig

__all__ = [
    "GenerationConfig",
    "JudgeConfig",
    "MMDUConfig",
    "MMVetConfig",
    "MDIConfig",
    "SyntheticConfig",
    "LmmsEvalConfig",
    "EvalConfig",
    "EvaluateConfig",
    "BENCHMARKS",
]

BENCHMARKS = ("synthetic", "mmdu", "mmvet", "mdi", "lmms_eval")


@dataclass
class GenerationConfig:
    max_new_tokens: int = 2048
    """Upper bound of tokens generated per answer (MMDU's official setting is 2048)."""
    do_sample: bool = False
    """Greedy decoding (False, the MMDU protocol) or sampling with temperature/top_p."""
    temperature: float = 1.0
    """Sampling temperature; ignored when ``do_sample`` is False."""
    top_p: float = 1.0
    """Nucleus sampling mass; ignored when ``do_sample`` is False."""
    repetition_penalty: float = 1.0
    """>1 discourages repeats (XComposer2's chat used 1.005)."""
    seed: int = 0
    """Seed of the sampling generator (only used when ``do_sample``)."""
    kv_reuse: bool = True
    """Keep the KV cache across turns and feed only the new tokens (the history is a
    prefix of the next prompt). False re-encodes the whole history every turn; that path
    batches several dialogues per forward pass."""
    batch_size: Optional[int] = None
    """Dialogues decoded together. On the KV path they share one batched cache and each
    turn feeds only its new tokens; a slot whose dialogue ends takes the next one. Answers
    do not depend on it (greedy). ``None``: by model size, from ``batch_size_by_size``."""
    batch_schedule: str = "auto"
    """How rows of a batched KV cache take turns: ``continuous`` (a row starts its next
    turn as soon as its answer ends: fewest forward calls, best where decoding is bound by
    memory bandwidth, i.e. on a GPU), ``lockstep`` (rows start turns together: far less
    padding, faster where every token costs compute, i.e. on a CPU), or ``auto``
    (continuous on CUDA, lockstep elsewhere). Answers do not depend on it (greedy)."""
    batch_size_by_size: dict[str, int] = field(default_factory=lambda: {"3B": 16, "9B": 8, "20B": 4, "inf": 2})
    """Batch size for models up to each size (``"9B"``: up to 9e9 parameters). Each row
    keeps a KV cache of up to ``context_length`` tokens (LLaVA-1.5-7B in bf16: 0.5 MiB
    per token, 4 GiB per 8k dialogue), so larger models get smaller batches."""
    context_length: Optional[int] = None
    """Context window in tokens used for the overflow policy; ``None`` = the model's
    ``max_position_embeddings``. Table 5 evaluates the same model at 2k/4k/8k."""
    overflow: str = "drop_oldest"
    """What to do when prompt + ``min_new_tokens`` exceeds the window: ``drop_oldest``
    (drop the oldest exchanges, keep images later turns refer to by name) or ``stop``
    (answer no more turns of that dialogue). Recorded per turn."""
    min_new_tokens: int = 64
    """Room kept free for the answer when deciding whether a prompt fits."""
    system_prompt: Optional[str] = None
    """Overrides the chat template's system prompt (``""`` = none; ``None`` = template default)."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cpu`` or ``cuda:N``."""


@dataclass
class JudgeConfig:
    model: Optional[str] = None
    """Judge model name (e.g. ``gpt-4o-2024-05-13``); ``None`` reads the env var ``model_env``."""
    model_env: str = "MMTUNE_JUDGE_MODEL"
    """Environment variable holding the judge model name when ``model`` is unset."""
    base_url_env: str = "MMTUNE_JUDGE_BASE_URL"
    """Environment variable with the OpenAI-compatible base URL (unset = api.openai.com)."""
    api_key_env: str = "MMTUNE_JUDGE_API_KEY"
    """Environment variable with the API key. The key is never logged or written anywhere.
    When this variable and ``base_url_env`` are unset, the openai SDK's own
    ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL`` are used (the start-up line names the source)."""
    max_failed_share: float = 0.0
    """Largest share of judge calls allowed to fail (after retries) before the evaluation
    exits with an error. 0.0 = any failed call is an error: a judge that fails must never
    look like a model that scored zero. Results and details are written first either way."""
    stop_after_failures: int = 20
    """Stop sending once this many calls failed and none succeeded (bad key, wrong URL,
    server down): the remaining items fail at once instead of paying retries each."""
    concurrency: int = 8
    """Judge calls in flight at once. Raise it for a local vLLM server; lower it on 429s."""
    timeout_s: float = 120.0
    """Per-request timeout; a timeout is retried."""
    max_retries: int = 6
    """Retries on 429 / 5xx / timeouts / malformed replies before the item counts as failed."""
    backoff_base_s: float = 1.0
    """First backoff; attempt n waits uniform(0, min(backoff_max_s, base * 2**n)) (full jitter)."""
    backoff_max_s: float = 60.0
    """Cap of one backoff wait."""
    max_tokens: int = 2048
    """Max tokens of a judge reply."""
    send_images: bool = False
    """Attach the item's images to judge calls (MMDU's official judge does; VLMEvalKit's
    port does not). Off = text-only judging, which needs no image files."""
    cache_path: Optional[str] = None
    """SQLite cache of judge replies; ``None`` = ``<output_dir>/judge_cache.sqlite``."""
    prices: dict[str, Any] = field(
        default_factory=lambda: {
            "gpt-4o": {"input": 2.5, "output": 10.0},
            "gpt-4o-mini": {"input": 0.15, "output": 0.6},
            "gpt-4-0613": {"input": 30.0, "output": 60.0},
        }
    )
    """USD per million input / output tokens, by model name (longest matching prefix wins)."""


@dataclass
class MMDUConfig:
    data_path: Optional[str] = None
    """MMDU ``benchmark.json`` (references and questions)."""
    image_root: Optional[str] = None
    """Directory the ``image`` paths are relative to (leading ``/`` is stripped)."""
    predictions: Optional[str] = None
    """Score this file instead of generating: MMDU-schema dialogues whose assistant turns
    hold the model's answers, or a generation JSONL written by mmtune."""
    prompt_file: Optional[str] = None
    """Replacement judge prompt with ``{question}``, ``{reference}``, ``{answer}`` fields."""
    limit: Optional[int] = None
    """Evaluate only the first N dialogues (smoke runs)."""


@dataclass
class MMVetConfig:
    data_path: Optional[str] = None
    """``mm-vet.json``."""
    image_root: Optional[str] = None
    """Directory of MM-Vet's images."""
    predictions: Optional[str] = None
    """Answers to score instead of generating: MM-Vet results JSON ``{"v1_0": "answer", ...}``
    or LLaVA-style answer JSONL (``question_id`` / ``text`` per line)."""
    runs: int = 5
    """Judge runs; totals are reported as mean and std over runs (the paper uses 5)."""
    max_tries: int = 5
    """Tries per item and run; each unparsable reply raises the temperature by 0.5."""
    judge_model: Optional[str] = None
    """MM-Vet's own judge model (the paper: ``gpt-4-0613``); ``None`` = ``eval.judge``'s model.
    MM-Vet is always judged text-only, whatever ``judge.send_images`` says."""
    max_tokens: int = 3
    """Reply budget of a judge call: the reply is one number (the official grader allows 3 tokens)."""
    prompt_file: Optional[str] = None
    """The official evaluator's prompt saved to a file (no placeholders: the row is appended
    as the official script does), or a template with ``{question}``, ``{answer}``,
    ``{prediction}``. ``None`` = mmtune's own prompt (figures not comparable with published ones)."""
    bard_subset: Optional[str] = None
    """MM-Vet's ``bard_set.json``: evaluate only those items (file names get ``bardset_``)."""
    limit: Optional[int] = None
    """Evaluate only the first N items."""


@dataclass
class MDIConfig:
    data_path: Optional[str] = None
    """MDI-Benchmark items (JSON list or JSONL)."""
    image_root: Optional[str] = None
    """Directory of the png images (``image_path`` has no extension)."""
    predictions: Optional[str] = None
    """Items with a ``response`` field to score instead of generating."""
    alpha: float = 0.5
    """Score_final = alpha * level-1 accuracy + (1 - alpha) * level-2 accuracy."""
    limit: Optional[int] = None
    """Evaluate only the first N items."""


@dataclass
class SyntheticConfig:
    data_path: Optional[str] = None
    """Held-out split in MMDU benchmark schema (written by the data generator)."""
    image_root: Optional[str] = None
    """Directory the image paths are relative to (``None``: paths are absolute or relative to the file)."""
    predictions: Optional[str] = None
    """Score this file instead of generating (same forms as MMDU)."""
    limit: Optional[int] = None
    """Evaluate only the first N dialogues."""


@dataclass
class LmmsEvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["mmbench_en_dev", "mmmu_val", "mmstar", "mathvista_testmini", "ai2d", "hallusion_bench_image", "chartqa"])
    """lmms-eval task names (Table 3 by default; add blink, qbench2, mantis for Table 4)."""
    model_type: Optional[str] = None
    """lmms-eval ``--model``; ``None`` picks it from the model family (llava -> llava_hf)."""
    batch_size: int = 1
    """lmms-eval ``--batch_size``."""
    extra_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed through verbatim."""
    results_path: Optional[str] = None
    """Parse this recorded lmms-eval results JSON instead of running lmms-eval."""


@dataclass
class EvalConfig:
    """The ``eval/`` group: which benchmarks, how to generate, how to judge."""

    benchmarks: list[str] = field(default_factory=lambda: ["synthetic"])
    """Benchmarks to run, from: synthetic, mmdu, mmvet, mdi, lmms_eval."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    mmdu: MMDUConfig = field(default_factory=MMDUConfig)
    mmvet: MMVetConfig = field(default_factory=MMVetConfig)
    mdi: MDIConfig = field(default_factory=MDIConfig)
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    lmms_eval: LmmsEvalConfig = field(default_factory=LmmsEvalConfig)
    allow_absolute_image_paths: bool = False
    """Accept absolute image paths outside a benchmark's ``image_root`` (default: the data
    file's folder). Off: such a path, or one escaping the root through ``..``/symlinks,
    fails loading with ``path_outside_root`` (see :mod:`mmtune.data.paths`)."""
    report: bool = True
    """Write ``report.md`` with tables and PNG plots next to the result JSONs."""
    progress: bool = True
    """Show progress bars for generation and judging."""


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


def default_output_dir(run_name: str, checkpoint: Optional[str], model: ModelConfig) -> str:
    """``outputs/eval/<run_name>/<model>``: the checkpoint's (else ``model.path``'s) last
    two path parts and a hash of its absolute path, or ``random-<family>``."""
    import hashlib
    import os
    import re

    target = checkpoint or model.path
    if not target:
        slug = f"random-{model.family}"
    else:
        absolute = os.path.abspath(target) if os.path.exists(target) else target
        tail = "-".join(p for p in absolute.replace("\\", "/").split("/")[-2:] if p)
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", tail) + "-" + hashlib.sha1(absolute.encode()).hexdigest()[:8]
    return os.path.join("outputs", "eval", run_name, slug)


def validate_eval_config(cfg: EvalConfig) -> None:
    """Collect every problem of ``cfg`` (and of each chosen benchmark's settings) and raise once."""
    import dataclasses
    import math

    from mmtune.evaluation.benchmarks import get_benchmark, registered_names

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
    judge = cfg.judge
    if not 0.0 <= judge.max_failed_share <= 1.0:
        problems.append(f"eval.judge.max_failed_share={judge.max_failed_share}: must be within [0, 1]")
    if judge.concurrency < 1:
        problems.append(f"eval.judge.concurrency={judge.concurrency}: must be >= 1")
    if not (math.isfinite(judge.timeout_s) and judge.timeout_s > 0):
        problems.append(f"eval.judge.timeout_s={judge.timeout_s}: must be a finite number of seconds > 0")
    if judge.max_retries < 0:
        problems.append(f"eval.judge.max_retries={judge.max_retries}: must be >= 0 (0: no retries)")
    for key in ("backoff_base_s", "backoff_max_s"):
        value = getattr(judge, key)
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"eval.judge.{key}={value}: must be a finite number of seconds >= 0")
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

"""Hand-off of the other Table 3 / Table 4 benchmarks to lmms-eval (optional extra).

mmtune exports a normal HF checkpoint, so lmms-eval runs on it with its own model
wrapper (``llava_hf`` for LLaVA checkpoints). Families lmms-eval has no wrapper for
(InternLM-XComposer2 as mmtune runs it) use mmtune's own generator, registered in
lmms-eval as the model ``mmtune`` by :mod:`mmtune.evaluation.lmms_model`, whose launcher
the command then runs. :func:`build_command` returns the command;
:func:`parse_results` turns lmms-eval's results JSON (``{"results": {task: {"metric,filter":
value, ...}}, "configs": ..., "n-samples": ...}``) into one mmtune result per task.

Headline metrics: lmms-eval names a task's metrics itself; :data:`HEADLINE` says which
one the MMDU paper's tables report and its scale (fractions are multiplied by 100).
Every numeric metric is kept in ``metrics`` under its own name as well (``<metric>`` for
filter ``none``, else ``<metric>/<filter>``); standard errors go to ``meta``.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.evaluation.benchmarks.base import Benchmark, BenchmarkWork, RunContext
from mmtune.evaluation.benchmarks.registry import register
from mmtune.evaluation.results import BenchmarkResult
from mmtune.io.nofollow import write_output_text

__all__ = ["LmmsEvalConfig", "MODEL_TYPES", "HEADLINE", "build_command", "parse_results", "find_results_file", "run_lmms_eval",
           "LmmsEvalBenchmark"]


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

#: model family -> lmms-eval ``--model`` for an exported HF checkpoint; ``mmtune`` is
#: mmtune's own generator registered in lmms-eval (any family mmtune can load)
MODEL_TYPES = {"llava": "llava_hf", "internlm_xcomposer2": "mmtune", "qwen2_vl": "mmtune"}
MMTUNE_MODEL = "mmtune"

#: task -> (metric key in lmms-eval's results, factor to percent); best-known defaults
HEADLINE: dict[str, tuple[str, float]] = {
    "mmbench_en_dev": ("gpt_eval_score", 1.0),
    "mmmu_val": ("mmmu_acc", 100.0),
    "mmstar": ("average", 100.0),
    "mathvista_testmini": ("gpt_eval_score", 1.0),
    "ai2d": ("exact_match", 100.0),
    "hallusion_bench_image": ("aAcc", 1.0),
    "chartqa": ("relaxed_overall", 100.0),
    "blink": ("blink_acc", 100.0),
    "qbench2_dev": ("qbench2_acc", 100.0),
    "mantis": ("mantis_score", 100.0),
}


def build_command(
    checkpoint: str,
    cfg: LmmsEvalConfig,
    *,
    family: str,
    output_path: str,
    python: str = sys.executable,
    model_config_file: Optional[str] = None,
) -> list[str]:
    """The lmms-eval command for ``checkpoint`` (an exported HF directory or hub id).

    With model type ``mmtune`` the command runs mmtune's launcher, which registers
    mmtune's generator in lmms-eval and then hands over to lmms-eval's own CLI;
    ``model_config_file`` (a JSON of the ModelConfig) tells it how to load the model.

    Raises:
        ValueError: when no lmms-eval model type is known for ``family`` and none is set.
    """
    model_type = cfg.model_type or MODEL_TYPES.get(family)
    if model_type is None:
        raise ValueError(
            f"no lmms-eval model type known for model family {family!r}; set eval.lmms_eval.model_type "
            f"(known defaults: {MODEL_TYPES}; 'mmtune' runs any family through mmtune's own generator)"
        )
    if not cfg.tasks:
        raise ValueError("eval.lmms_eval.tasks is empty; list lmms-eval task names such as mmmu_val")
    model_args = f"pretrained={checkpoint}"
    module = "lmms_eval"
    if model_type == MMTUNE_MODEL:
        module = "mmtune.evaluation.lmms_model"
        model_args += f",family={family}"
        if model_config_file:
            model_args += f",model_config={model_config_file}"
    return [
        python, "-m", module,
        "--model", model_type,
        "--model_args", model_args,
        "--tasks", ",".join(cfg.tasks),
        "--batch_size", str(cfg.batch_size),
        "--output_path", output_path,
        "--log_samples",
        *cfg.extra_args,
    ]


def find_results_file(output_path: str) -> Path:
    """The newest ``*results*.json`` lmms-eval wrote under ``output_path``."""
    candidates = sorted(Path(output_path).rglob("*results*.json"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise FileNotFoundError(f"no lmms-eval results JSON under {output_path}; check the lmms-eval log above")
    return candidates[-1]


def parse_results(path: str | Path, *, run: str, model: str, tasks: Optional[Sequence[str]] = None) -> list[BenchmarkResult]:
    """One :class:`BenchmarkResult` per task in lmms-eval's results file.

    Raises:
        ValueError: when the file is not an lmms-eval results JSON or a requested task is absent.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError(f"{path}: not an lmms-eval results file (no 'results' mapping)")
    missing = [t for t in (tasks or []) if t not in data["results"]]
    if missing:
        raise ValueError(f"{path}: tasks {missing} are not in the results (found {sorted(data['results'])})")
    n_samples = data.get("n-samples") or {}
    out = []
    for task, values in data["results"].items():
        if tasks and task not in tasks:
            continue
        metrics: dict[str, float] = {}
        stderr: dict[str, float] = {}
        for key, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            name = metric if filt in ("", "none") else f"{metric}/{filt}"
            if metric.endswith("_stderr"):
                stderr[name] = float(value)
            else:
                metrics[name] = float(value)
        headline = HEADLINE.get(task)
        if headline and headline[0] in metrics:
            metrics["score"] = metrics[headline[0]] * headline[1]
        counts = {}
        if isinstance(n_samples.get(task), dict):
            counts = {k: int(v) for k, v in n_samples[task].items() if isinstance(v, (int, float))}
        meta = {
            "source": "lmms-eval",
            "results_file": str(path),
            "headline": headline[0] if headline else None,
            "stderr": stderr,
            "lmms_eval_version": (data.get("config") or {}).get("lmms_eval_version") or data.get("lmms_eval_version"),
        }
        out.append(BenchmarkResult(run, model, task, metrics, counts, meta))
    return out


def lmms_eval_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("lmms_eval") is not None


def run_lmms_eval(checkpoint: str, cfg: LmmsEvalConfig, *, family: str, output_path: str, run: str, model: str,
                  model_config_file: Optional[str] = None, runner: Any = subprocess.run) -> list[BenchmarkResult]:
    """Run lmms-eval (when ``cfg.results_path`` is unset) and parse its results."""
    if cfg.results_path:
        return parse_results(cfg.results_path, run=run, model=model, tasks=cfg.tasks)
    if not lmms_eval_installed():
        raise RuntimeError(_NOT_INSTALLED)
    command = build_command(checkpoint, cfg, family=family, output_path=output_path, model_config_file=model_config_file)
    print("running:", shlex.join(command), flush=True)
    runner(command, check=True)
    return parse_results(find_results_file(output_path), run=run, model=model, tasks=cfg.tasks)


_NOT_INSTALLED = (
    "lmms-eval is not installed: `pip install 'mmtune[lmms-eval]'` (with a CUDA torch; next to a CPU-only torch: "
    "`pip install --no-deps lmms-eval==0.7.3 && pip install 'mmtune[lmms-eval-runtime]'`), or run the command "
    "printed by `mmtune evaluate lmms-command` elsewhere and set eval.lmms_eval.results_path to its results JSON"
)


@register
class LmmsEvalBenchmark(Benchmark):
    """The other Table 3 / Table 4 columns, run by lmms-eval on the same model."""

    name = "lmms_eval"
    settings_class = LmmsEvalConfig
    generates = False

    def check(self, cfg: Any) -> list[str]:
        sub = cfg.lmms_eval
        problems = []
        if not sub.tasks:
            problems.append("eval.lmms_eval.tasks is empty; list lmms-eval task names such as mmmu_val")
        return problems

    def preflight(self, ctx: RunContext) -> list[str]:
        sub = ctx.cfg.lmms_eval
        if sub.results_path:
            return []
        problems = [] if lmms_eval_installed() else ["eval.lmms_eval: " + _NOT_INSTALLED]
        if not ctx.lmms_pretrained:
            problems.append("eval.lmms_eval needs a model: set `checkpoint` or `model.path` (or eval.lmms_eval.results_path)")
        model_type = sub.model_type or MODEL_TYPES.get(ctx.family or "")
        if model_type is None:
            problems.append(f"eval.lmms_eval: no lmms-eval model type known for family {ctx.family!r}; set "
                            f"eval.lmms_eval.model_type (known: {MODEL_TYPES})")
        elif ctx.lmms_is_adapter and model_type != MMTUNE_MODEL:
            problems.append(
                f"{ctx.checkpoint} is a LoRA adapter without merged weights; lmms-eval's {model_type} needs a full HF "
                "checkpoint. Evaluate the run's final/ saved with peft.merge_on_save=true, or set "
                "eval.lmms_eval.model_type=mmtune (mmtune's generator loads adapters)"
            )
        return problems

    def count_work(self, sub: Any, cache_dir: Optional[str]) -> tuple[BenchmarkWork, list[str]]:
        """Nothing to count here: lmms-eval reads its own task data."""
        return BenchmarkWork(self.name, None, 0, 0, 0, 0, note="lmms-eval tasks " + ", ".join(sub.tasks)), []

    def evaluate(self, ctx: RunContext) -> list[BenchmarkResult]:
        import dataclasses
        import json

        sub = ctx.cfg.lmms_eval
        config_file = None
        if ctx.model_config is not None:
            config_file = ctx.out / "lmms_eval" / "mmtune_model.json"
            config_file.parent.mkdir(parents=True, exist_ok=True)
            write_output_text(config_file, json.dumps(dataclasses.asdict(ctx.model_config), indent=2, default=str))
        return run_lmms_eval(ctx.lmms_pretrained or "", sub, family=ctx.family or "llava",
                             output_path=str(ctx.out / "lmms_eval"), run=ctx.run, model=ctx.model,
                             model_config_file=str(config_file) if config_file else None, runner=ctx.command_runner)

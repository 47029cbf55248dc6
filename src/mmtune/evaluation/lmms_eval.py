"""Hand-off of the other Table 3 / Table 4 benchmarks to lmms-eval (optional extra).

mmtune exports a normal HF checkpoint, so lmms-eval runs on it with its own model
wrapper (``llava_hf`` for LLaVA checkpoints). :func:`build_command` returns the command;
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
from pathlib import Path
from typing import Optional, Sequence

from mmtune.evaluation.config import LmmsEvalConfig
from mmtune.evaluation.results import BenchmarkResult

__all__ = ["MODEL_TYPES", "HEADLINE", "build_command", "parse_results", "find_results_file", "run_lmms_eval"]

#: model family -> lmms-eval ``--model`` for an exported HF checkpoint
MODEL_TYPES = {"llava": "llava_hf"}

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
) -> list[str]:
    """The lmms-eval command for ``checkpoint`` (an exported HF directory).

    Raises:
        ValueError: when no lmms-eval model type is known for ``family`` and none is set.
    """
    model_type = cfg.model_type or MODEL_TYPES.get(family)
    if model_type is None:
        raise ValueError(
            f"no lmms-eval model type known for model family {family!r}; set eval.lmms_eval.model_type "
            f"(known defaults: {MODEL_TYPES})"
        )
    if not cfg.tasks:
        raise ValueError("eval.lmms_eval.tasks is empty; list lmms-eval task names such as mmmu_val")
    return [
        python, "-m", "lmms_eval",
        "--model", model_type,
        "--model_args", f"pretrained={checkpoint}",
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


def run_lmms_eval(checkpoint: str, cfg: LmmsEvalConfig, *, family: str, output_path: str, run: str, model: str) -> list[BenchmarkResult]:
    """Run lmms-eval (when ``cfg.results_path`` is unset) and parse its results."""
    if cfg.results_path:
        return parse_results(cfg.results_path, run=run, model=model, tasks=cfg.tasks)
    import importlib.util

    if importlib.util.find_spec("lmms_eval") is None:
        raise RuntimeError(
            "lmms-eval is not installed: `pip install 'mmtune[lmms-eval]'`, or run the command printed by "
            "`mmtune evaluate lmms-command` elsewhere and set eval.lmms_eval.results_path to its results JSON"
        )
    command = build_command(checkpoint, cfg, family=family, output_path=output_path)
    print("running:", shlex.join(command), flush=True)
    subprocess.run(command, check=True)
    return parse_results(find_results_file(output_path), run=run, model=model, tasks=cfg.tasks)

"""The result file every benchmark run writes: one JSON object per (model, benchmark, run).

Schema (shared with the report tables and the trainer)::

    {"run": str, "model": str, "benchmark": str, "context_length": int | null,
     "metrics": {name: float}, "counts": {name: int}, "meta": {...}}

``metrics`` hold the headline numbers on the benchmark's own scale (MMDU and MM-Vet
x100-style scores, accuracies in percent); ``counts`` say how many items went into them
and how many failed; ``meta`` holds settings and breakdown tables. Secrets (judge key,
base URL) never enter a result: only the judge model name does.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from mmtune.io.nofollow import write_output_text

__all__ = ["BenchmarkResult", "write_result", "read_result", "result_filename"]


@dataclass
class BenchmarkResult:
    """One benchmark run's numbers."""

    run: str
    """Run name (the training run or a user label)."""
    model: str
    """Model label: checkpoint path or name."""
    benchmark: str
    """``mmdu``, ``mmvet``, ``mdi``, ``synthetic`` or an lmms-eval task name."""
    metrics: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    context_length: Optional[int] = None
    """Evaluation context window in tokens (Table 5 varies it); ``None`` = the model's own."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {key: data[key] for key in ("run", "model", "benchmark", "context_length", "metrics", "counts", "meta")}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, where: str = "<dict>") -> "BenchmarkResult":
        problems = [f"missing key {key!r}" for key in ("run", "model", "benchmark", "metrics") if key not in data]
        unknown = sorted(set(data) - {"run", "model", "benchmark", "context_length", "metrics", "counts", "meta"})
        problems += [f"unknown key {key!r}" for key in unknown]
        for name, value in (data.get("metrics") or {}).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                problems.append(f"metric {name!r} is {type(value).__name__}, expected a number")
        if problems:
            raise ValueError(f"{where}: not an mmtune result: " + "; ".join(problems))
        return cls(
            run=data["run"],
            model=data["model"],
            benchmark=data["benchmark"],
            metrics={k: float(v) for k, v in data["metrics"].items()},
            counts=dict(data.get("counts") or {}),
            meta=dict(data.get("meta") or {}),
            context_length=data.get("context_length"),
        )


def _finite(value: Any) -> Any:
    # JSON has no NaN; a metric over zero items is written as null rather than an invalid file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def result_filename(result: BenchmarkResult) -> str:
    ctx = f"-ctx{result.context_length}" if result.context_length else ""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{result.benchmark}{ctx}")
    return f"{safe}.json"


def write_result(result: BenchmarkResult, out_dir: str | os.PathLike) -> Path:
    """Write ``result`` to ``out_dir/<benchmark>[-ctx<N>].json`` atomically and return the path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / result_filename(result)
    tmp = path.with_suffix(".json.tmp")
    data = result.to_dict()
    data["metrics"] = {k: (v if math.isfinite(v) else None) for k, v in data["metrics"].items()}
    write_output_text(tmp, json.dumps(_finite(data), indent=2, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_result(path: str | os.PathLike) -> BenchmarkResult:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    data["metrics"] = {k: (float("nan") if v is None else v) for k, v in data.get("metrics", {}).items()}
    return BenchmarkResult.from_dict(data, where=str(path))

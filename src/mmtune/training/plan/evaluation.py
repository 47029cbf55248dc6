"""One evaluation run planned: model, benchmark data, judge calls, memory and generation time."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.compose import compose_checked
from mmtune.evaluation.benchmarks.base import BenchmarkWork
from mmtune.training.plan.common import PlanError, human
from mmtune.training.plan.gpus import DTYPE_BYTES, GPU_TYPES, OVERHEAD_GIB, GpuType
from mmtune.training.plan.model import ParamCounts, checkpoint_config, count_parameters

__all__ = ["EvalPlan", "plan_evaluation", "plan_generation", "render_generation_estimates"]


@dataclass
class EvalPlan:
    overrides: list[str]
    run_name: str
    output_dir: str
    model: dict[str, Any]
    params: Optional[dict[str, Any]]
    context_length: Optional[int]
    benchmarks: list[dict[str, Any]]
    judge_model: Optional[str]
    memory_gib: dict[str, float]
    decode_gpu_hours_max: float
    gpu: str
    fits: bool
    generation: list[dict[str, Any]] = field(default_factory=list)
    """Per benchmark: :class:`mmtune.evaluation.generation.throughput.GenerationEstimate` as a dict,
    plus ``gpus`` and ``hours_wall`` of a data-parallel evaluation on that many GPUs."""
    gpus: int = 1
    """Data-parallel GPUs the evaluation is planned for (``mmtune plan --gpus``)."""
    served_model: Optional[str] = None
    """The served model of ``eval.generation.backend: api`` (no local generation then)."""

    def render(self) -> str:
        m = self.model
        lines = [f"== evaluation {self.run_name}  [{' '.join(self.overrides)}]", f"  output      {self.output_dir}",
                 f"  model       {m['family']}  path={m['path']}  dtype={m['torch_dtype']}"]
        if self.params:
            lines.append(f"  parameters  total {human(self.params['total'])}  [{self.params['source']}]")
        lines.append(f"  window      {self.context_length or 'the model default'}")
        for b in self.benchmarks:
            what = (f"{b['items']:,} items, {b['answers']:,} answers, {b['images']:,} images, "
                    f"{b['judge_calls']:,} judge calls" if b["items"] else b["note"])
            lines.append(f"  benchmark   {b['name']:<10} {what}" + (f"  {b['data_path']}" if b["data_path"] else ""))
        lines.append(f"  judge       {self.judge_model or 'from $MMTUNE_JUDGE_MODEL'}")
        if self.served_model:
            answers = sum(b["answers"] for b in self.benchmarks)
            lines.append(f"  generation  served model {self.served_model!r} ($MMTUNE_GEN_BASE_URL): {answers:,} calls, "
                         "no local GPU")
            return "\n".join(lines)
        mem = self.memory_gib
        lines.append("  memory/GPU  " + ", ".join(f"{k} {v:.1f}" for k, v in mem.items() if k != "total")
                     + f" => {mem['total']:.1f} GiB on {self.gpu} " + ("(fits)" if self.fits else "(DOES NOT FIT)"))
        lines.append(f"  generation  <= {self.decode_gpu_hours_max:.1f} GPU-hours if every answer used max_new_tokens "
                     "(greedy decoding is bandwidth-bound: weight bytes / HBM bandwidth per token)")
        lines += render_generation_estimates(self.generation)
        return "\n".join(lines)


def plan_generation(gen_cfg: Any, model_cfg: Any, params: ParamCounts, benches: Sequence[BenchmarkWork],
                    gpu: GpuType, num_gpus: int = 1) -> list[dict[str, Any]]:
    """Generation time of each benchmark on the batched KV path (or re-encoding), at the
    batch size the config resolves to for this model, on one GPU and split across
    ``num_gpus``; see :mod:`mmtune.evaluation.generation.throughput`."""
    from mmtune.evaluation.generation.throughput import estimate_data_parallel, estimate_generation, resolve_batch_size

    text = checkpoint_config(model_cfg)[0] or {}
    text = text.get("text_config") or text
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    wbytes = DTYPE_BYTES.get(model_cfg.torch_dtype, 4)
    kv_per_token = 2 * params.num_layers * kv_heads * (params.hidden_size // heads) * wbytes
    window = gen_cfg.context_length or int(text.get("max_position_embeddings") or 4096)
    batch = resolve_batch_size(gen_cfg, params.total)
    out = []
    for b in benches:
        if not b.answers:
            continue
        shared = dict(tokens_per_image=params.image_tokens or 0, answer_tokens=gen_cfg.max_new_tokens, batch_size=batch,
                      params=params.total, weight_bytes=wbytes * params.total, kv_bytes_per_token=kv_per_token,
                      window=window, hbm_tbps=gpu.hbm_tbps, peak_tflops=gpu.peak_tflops, kv_reuse=gen_cfg.kv_reuse)
        est = estimate_generation(b.name, dialogues=b.items, answers=b.answers, images=b.images, **shared)
        used, share = estimate_data_parallel(b.name, gpus=num_gpus, dialogues=b.items, answers=b.answers,
                                             images=b.images, **shared)
        out.append({**asdict(est), "gpus": used, "hours_wall": share.hours,
                    "dialogues_per_gpu": math.ceil(max(b.items, 1) / used), "answers_per_gpu": share.answers})
    return out


def render_generation_estimates(estimates: Sequence[dict[str, Any]]) -> list[str]:
    """Plan lines of :func:`plan_generation`'s estimates."""
    from mmtune.evaluation.generation.throughput import DECODE_EFFICIENCY

    lines = []
    for e in estimates:
        lines.append(f"  gen time    {e['benchmark']:<10} <= {e['hours']:.2f} GPU-h at B={e['batch_size']} "
                     f"(B=1: {e['hours_batch1']:.2f}); {e['answers']:,} answers x {e['answer_tokens']} tokens in "
                     f"{e['rounds']:,} rounds, {human(e['prefill_tokens'])} prefill tokens, "
                     f"decode {e['decode_tokens_per_s']:,.0f} tok/s")
        if e.get("gpus", 1) > 1:
            lines.append(f"              on {e['gpus']} GPUs: <= {e['hours_wall']:.2f} h wall, {e['dialogues_per_gpu']:,} "
                         f"dialogues / {e['answers_per_gpu']:,} answers per GPU (data-parallel, balanced by tokens)")
    if lines:
        lines.append(f"              (decode at {DECODE_EFFICIENCY:.0%} of HBM bandwidth, weights + KV read per step; "
                     "every answer at max_new_tokens)")
    return lines


def plan_evaluation(overrides: Sequence[str], *, gpu: str = "a100-80g", num_gpus: int = 1) -> EvalPlan:
    """Resolve one ``recipes/evaluate.py`` run: model, benchmark data, judge calls, memory,
    and generation time on one GPU and on ``num_gpus`` (a data-parallel evaluation)."""
    from mmtune.evaluation.benchmarks.registry import get_benchmark
    from mmtune.evaluation.config import to_evaluate_config

    if gpu not in GPU_TYPES:
        raise PlanError(f"unknown GPU type {gpu!r}; known: {', '.join(GPU_TYPES)}")
    try:
        cfg = to_evaluate_config(compose_checked(overrides, "evaluate", command="mmtune plan --recipe evaluate"))
    except Exception as err:  # noqa: BLE001 - config errors name the key; report them with the run
        raise PlanError(f"evaluation config [{' '.join(overrides)}] is invalid:\n{err}") from err
    problems: list[str] = []
    model_cfg = copy.copy(cfg.model)
    if cfg.checkpoint:
        run_file = Path(cfg.checkpoint) / "mmtune_run.json"
        if not Path(cfg.checkpoint).is_dir():
            problems.append(f"checkpoint={cfg.checkpoint!r} does not exist (train it first, or fix the path)")
        elif run_file.is_file():
            model_cfg.family = json.loads(run_file.read_text()).get("family", model_cfg.family)
        model_cfg.path = cfg.checkpoint
    served = cfg.eval.generation.api.model if cfg.eval.generation.backend == "api" else None
    params = None
    if not served:  # a served model answers: nothing is loaded here, no parameters to count
        try:
            peft = argparse.Namespace(method="none", r=0, target_modules=None)
            frozen = argparse.Namespace(**{g: argparse.Namespace(train=False) for g in ("vision", "projector",
                                                                                       "language_model")})
            params = count_parameters(model_cfg, peft, frozen)
        except PlanError as err:
            problems.append(str(err))
    from mmtune.data.config import default_cache_dir

    cache_dir = os.path.join(default_cache_dir(), "eval")
    benches = []
    for name in cfg.eval.benchmarks:
        bench = get_benchmark(name)
        work, found = bench.count_work(bench.settings(cfg.eval), cache_dir)
        benches.append(work)
        problems += found
    if problems:
        raise PlanError(f"evaluation [{' '.join(overrides)}]:\n" + "\n".join(problems))
    g = GPU_TYPES[gpu]
    wbytes = DTYPE_BYTES.get(model_cfg.torch_dtype, 4)
    window = cfg.eval.generation.context_length
    mem = {"weights": 0.0, "kv_cache": 0.0, "overhead": OVERHEAD_GIB}
    hours = 0.0
    if params:
        text = checkpoint_config(model_cfg)[0] or {}
        text = text.get("text_config") or text
        heads = int(text.get("num_attention_heads") or 1)
        kv = int(text.get("num_key_value_heads") or heads)
        window_tokens = window or int(text.get("max_position_embeddings") or 4096)
        mem["weights"] = wbytes * params.total / 1024**3
        mem["kv_cache"] = 2 * params.num_layers * kv * (params.hidden_size // heads) * window_tokens * wbytes / 1024**3
        answers = sum(b.answers for b in benches)
        hours = answers * cfg.eval.generation.max_new_tokens * (wbytes * params.total) / (g.hbm_tbps * 1e12) / 3600
    mem["total"] = sum(mem.values())
    return EvalPlan(
        overrides=list(overrides), run_name=cfg.run_name, output_dir=cfg.output_dir,
        model={k: getattr(model_cfg, k) for k in ("family", "path", "torch_dtype", "attn_implementation")},
        params=asdict(params) if params else None, context_length=window,
        benchmarks=[asdict(b) for b in benches], judge_model=cfg.eval.judge.model, memory_gib=mem,
        decode_gpu_hours_max=hours, gpu=g.name, fits=mem["total"] <= g.memory_gib,
        generation=plan_generation(cfg.eval.generation, model_cfg, params, benches, g, num_gpus) if params else [],
        gpus=num_gpus, served_model=served,
    )

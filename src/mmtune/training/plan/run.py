"""One training run planned: model, data, context, LoRA, engine, steps, tokens, GPU-hours, memory."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

from mmtune.compose import compose_checked
from mmtune.data.batching import steps_per_epoch
from mmtune.training.layout import RankLayout
from mmtune.training.plan.common import PlanError, human
from mmtune.training.plan.gpus import DTYPE_BYTES
from mmtune.training.launch import LaunchFileError, launcher_problem, launcher_processes
from mmtune.training.plan.cost import estimate_cost
from mmtune.training.plan.data import DataPlan, plan_data
from mmtune.training.plan.gpus import GPU_TYPES
from mmtune.training.plan.model import ParamCounts, checkpoint_config, count_parameters, meta_model

__all__ = ["RunPlan", "plan_run"]


@dataclass
class RunPlan:
    overrides: list[str]
    run_name: Optional[str]
    output_dir: str
    model: dict[str, Any]
    params: Optional[dict[str, Any]]
    data: Optional[dict[str, Any]]
    context: dict[str, Any]
    peft: dict[str, Any]
    batching: dict[str, Any]
    attention: str
    """What the language model's attention runs while training (``training.packed_attention``)."""
    loss: str
    """The loss the loop will run (``training.loss_impl`` resolved as the loop resolves it, for
    CUDA GPUs) and, for a fallback, why."""
    engine: dict[str, Any]
    """The distributed engine as it describes itself (``description``), its settings section
    (``settings``: ``training.backend.<name>``), GPUs and where they come from (``origin``)."""
    cost: Optional[dict[str, Any]]
    evaluation: dict[str, Any]

    def render(self) -> str:
        lines = [f"== run {self.run_name or '(unnamed)'}  [{' '.join(self.overrides)}]",
                 f"  output      {self.output_dir}"]
        m = self.model
        lines.append(f"  model       {m['family']}  path={m['path']}  dtype={m['torch_dtype']}")
        if self.params:
            p = self.params
            lines.append(
                f"  parameters  total {human(p['total'])} (vision {human(p['vision'])}, "
                f"projector {human(p['projector'])}, language model {human(p['language_model'])}); "
                f"trainable {human(p['trainable'])}"
                + (f" incl. LoRA {human(p['lora'])}" if p["lora"] else "")
                + f"  [{p['source']}]"
            )
        c = self.context
        window = c["max_length"] or (f"{c['original']} (the model's own)" if c.get("original") else "the model's own")
        lines.append(f"  context     window {window}; " + (f"RoPE {c['rope_scaling']} x{c['factor']:g} from {c['original']}"
                                                            if c.get("factor") and c["factor"] > 1 else "RoPE unchanged"))
        pe = self.peft
        lines.append("  mode        " + ("full fine-tune" if pe["method"] == "none" else
                                          f"{pe['method']} r={pe['r']} alpha={pe['alpha']} dropout={pe['dropout']}")
                     + f"; train vision={pe['train_vision']} projector={pe['train_projector']} "
                     f"language_model={pe['train_language_model']}")
        if self.data:
            d = self.data
            lines.append(f"  data        strategy {d['strategy']}, mixture by {d['by']}"
                         + (f", weights {d['weights']}" if d["weights"] else ""))
            for s in d["sources"]:
                lines.append(f"    - {s['name']:<16} {s['format']:<8} kept {s['kept']:>9,} of {s['records']:>9,}; "
                             f"used/epoch {s['used_per_epoch']:>9,}; ~{human(s['estimated_tokens'])} tokens  "
                             f"{s['path']}")
            lines.append(f"  epoch       {d['samples_per_epoch']:,} samples, ~{human(d['tokens_per_epoch'])} tokens "
                         f"(mean {d['mean_tokens_per_sample']:.0f}/sample; {d['tokens_source']})")
            lines += ["  note        " + n.replace("\n", "\n              ") for n in d["notes"]]
        b = self.batching
        lines.append(f"  batching    {b['description']}")
        lines.append(f"  attention   {self.attention}")
        lines.append(f"  loss        {self.loss}")
        e = self.engine  # what the engine says of itself
        lines.append(f"  distributed {e['num_gpus']} GPU(s), {e['description']}  [{e['origin']}]")
        if self.cost:
            k = self.cost
            lines.append(f"  steps       {k['optimizer_steps']:,} optimizer steps, "
                         f"~{human(k['train_tokens'])} training tokens")
            lines.append(f"  compute     ~{k['flops']:.3g} FLOPs = {k['gpu_hours']:.3g} GPU-hours on {k['gpu']} at "
                         f"{k['utilization']:.0%} utilization ({k['wall_hours']:.3g} h wall on {k['num_gpus']})")
            mem = k["memory_gib"]
            lines.append("  memory/GPU  " + ", ".join(f"{key} {val:.1f}" for key, val in mem.items() if key != "total")
                         + f" => {mem['total']:.1f} GiB " + ("(fits)" if k["fits"] else "(DOES NOT FIT)"))
            sp = k.get("sequence_parallel", 1)
            how = (f"sequence parallelism over {sp} GPUs per row" if sp > 1
                   else "one GPU per row (training.sequence_parallel.size=1)")
            # the loop refuses rows past the model's position window (or the context extension's target)
            window = max(self.context.get("original") or 0, self.context.get("max_length") or 0)
            if window and k["longest_row_tokens"] > window:
                lines.append(f"  longest row ~{human(window)} tokens: the model's {window}-position window (memory "
                             f"alone would fit ~{human(k['longest_row_tokens'])} tokens a GPU with {how})")
            else:
                lines.append(f"  longest row ~{human(k['longest_row_tokens'])} tokens fit a GPU with {how}")
        e = self.evaluation
        if e["benchmarks"]:
            lines.append(f"  evaluation  {', '.join(e['benchmarks'])} at window {e['context_length'] or 'model default'}"
                         + (" before training" if e["before"] else "") + (" after training" if e["after"] else ""))
        return "\n".join(lines)


def _batching(cfg: Any, data: Optional[DataPlan], num_gpus: int, window: int) -> tuple[dict[str, Any], int, int]:
    """(description, optimizer steps, tokens per micro-batch) from the collator config.

    Micro-batches per epoch: ``samples / batch_size`` for padding batches; for packing
    and token budgets, ``tokens / row capacity`` (a lower bound: packing reaches ~98%
    fill, budgets less). Steps follow from them with the training loop's own
    :func:`~mmtune.data.batching.steps_per_epoch` (a partial last step per epoch counts).
    Tokens per micro-batch (for memory) is the worst case the collator allows. With
    ``training.sequence_parallel.size = N`` the ``num_gpus`` GPUs form ``num_gpus / N``
    data-parallel groups, each training one micro-batch at a time, as the loop deals them.
    """
    col = cfg.collator
    layout = RankLayout.of_run(cfg.training, num_processes=num_gpus)
    sp, groups, accum = layout.sequence_parallel, layout.data_ranks, layout.accumulation
    max_len = window
    epochs = cfg.training.epochs
    if col.batching == "packing":
        tokens_per_micro = col.batch_size * max_len
        desc = f"packing {col.batch_size} row(s) of {max_len} tokens per micro-batch"
        micro = math.ceil(data.tokens_per_epoch / tokens_per_micro) if data else 0
    elif col.batching == "token_budget":
        tokens_per_micro = int(col.max_tokens_per_batch or col.batch_size * max_len)
        desc = f"token budget {tokens_per_micro} padded tokens per micro-batch"
        micro = math.ceil(data.tokens_per_epoch / tokens_per_micro) if data else 0
    else:
        tokens_per_micro = col.batch_size * max_len
        desc = f"{col.batching}: {col.batch_size} sample(s) per micro-batch, each <= {max_len} tokens"
        micro = math.ceil(data.samples_per_epoch / col.batch_size) if data else 0
    per_step = layout.micro_batches_per_step
    steps = steps_per_epoch(micro, groups, accum) * epochs if data else 0  # the loop's own count
    if cfg.training.max_steps:
        steps = min(steps, cfg.training.max_steps) if steps else cfg.training.max_steps
    ranks = f"{num_gpus} GPU(s)" if sp == 1 else f"{groups} data-parallel group(s) of {sp} GPUs (sequence parallel)"
    desc += f" x {accum} accumulation x {ranks} = {per_step} micro-batches per step, {epochs} epoch(s)"
    return {"description": desc, "micro_batches_per_epoch": micro, "per_step": per_step}, steps, tokens_per_micro


def _composed(overrides: Sequence[str]) -> Any:
    """The run's typed config; a bad override is one line naming the key and the closest known one."""
    from mmtune.training.config import ConfigError, to_sft_config

    try:
        return to_sft_config(compose_checked(overrides, "sft", command="mmtune plan --recipe sft"))
    except (ConfigError, ValueError) as err:
        raise PlanError(f"config [{' '.join(overrides)}] is invalid:\n{err}") from err
    except Exception as err:  # OmegaConf errors name the key; pass them on with the run
        raise PlanError(f"config [{' '.join(overrides)}] does not resolve: {err}") from err


def _original_window(cfg: Any) -> Optional[int]:
    """The model's own position window (before any context extension), from the config or the checkpoint."""
    original = cfg.context.original_max_position_embeddings or cfg.model.max_position_embeddings
    if original is None:
        model_dict = checkpoint_config(cfg.model)[0]
        if model_dict:
            original = (model_dict.get("text_config") or model_dict).get("max_position_embeddings")
        elif cfg.model.path is None:
            original = ((cfg.model.architecture or {}).get("text_config") or {}).get("max_position_embeddings")
    return original


def _distributed(cfg: Any, accelerate_config: Optional[str], num_gpus: Optional[int],
                 problems: list[str]) -> tuple[int, str]:
    """``(GPUs, origin)`` of the run's engine: the launcher (``accelerate_config``, else the experiment's
    ``launcher`` key) checked against the engine, its process count when ``num_gpus`` is None; problems
    are appended to ``problems``."""
    launcher_note = ""
    if accelerate_config is None:
        accelerate_config = cfg.launcher
        if accelerate_config:
            launcher_note = ", the experiment's launcher (its `launcher` key)"
    backend = cfg.training.backend
    origin = f"training.backend.engine={backend.engine}" + (f" ({accelerate_config})" if accelerate_config else "")
    try:
        # The engine is the config's; a launcher that started another one (or other settings) is a
        # problem, as at start-up: the engine reads the launch file.
        problem = launcher_problem(backend, str(accelerate_config)) if accelerate_config else ""
        if problem:
            problems.append(problem)
        if num_gpus is None:
            num_gpus = (launcher_processes(accelerate_config) if accelerate_config else None) or 8
            launcher_note += f"; {num_gpus} GPU(s) from {'the launcher' if accelerate_config else 'the default'}"
    except LaunchFileError as err:
        problems.append(str(err))
        num_gpus = num_gpus or 8
    return num_gpus, origin + launcher_note


def _cost(cfg: Any, params: ParamCounts, data: DataPlan, batching: dict[str, Any], *, steps: int,
          micro_tokens: int, num_gpus: int, gpu: str, utilization: float, loss_impl: str) -> Any:
    """The cost estimate, memory per GPU as the run's engine holds its state (its ``state_memory``)."""
    from mmtune.training.engines import engine_class

    t, backend = cfg.training, cfg.training.backend
    engine_cls, engine_cfg = engine_class(backend.engine), getattr(backend, backend.engine)
    train_tokens = data.tokens_per_epoch * t.epochs
    if t.max_steps and steps:
        layout = RankLayout.of_run(t, num_processes=num_gpus)
        full = steps_per_epoch(batching["micro_batches_per_epoch"], layout.data_ranks, layout.accumulation) * t.epochs
        train_tokens = int(train_tokens * min(1.0, steps / max(1, full)))
    state = engine_cls.state_memory(engine_cfg, total=params.total, trainable=params.trainable,
                                    weight_bytes=DTYPE_BYTES.get(cfg.model.torch_dtype, 4), num_gpus=num_gpus,
                                    num_layers=params.num_layers,
                                    # input embeddings and output head (a tied pair counted twice: an upper bound)
                                    root_params=2 * params.hidden_size * params.vocab_size)
    return estimate_cost(
        params, train_tokens=train_tokens,
        train_images=int(data.images_per_epoch * t.epochs * (train_tokens / max(1, data.tokens_per_epoch * t.epochs))),
        mean_sample_tokens=min(data.mean_tokens_per_sample, micro_tokens), micro_batch_tokens=micro_tokens,
        optimizer_steps=steps, weight_dtype=cfg.model.torch_dtype, gradient_checkpointing=t.gradient_checkpointing,
        num_gpus=num_gpus, state=state, engine=engine_cls.describe(engine_cfg), gpu=GPU_TYPES[gpu],
        utilization=utilization, vision_trains=t.vision.train, loss_impl=loss_impl,
        loss_chunk_size=t.loss_chunk_size, head_trains=t.language_model.train and cfg.peft.method == "none",
        sequence_parallel=t.sequence_parallel.size)


def _sections(cfg: Any) -> dict[str, Any]:
    """The plan's sections read straight off the config: model, LoRA, attention, engine, evaluation."""
    from mmtune.training.engines import engine_class
    from mmtune.training.packed_attention import resolve_attention

    t, backend, ev = cfg.training, cfg.training.backend, cfg.eval
    engine_cls, engine_cfg = engine_class(backend.engine), getattr(backend, backend.engine)
    return dict(
        model={k: getattr(cfg.model, k) for k in ("family", "path", "torch_dtype", "attn_implementation")},
        peft={"method": cfg.peft.method, "r": cfg.peft.r, "alpha": cfg.peft.alpha, "dropout": cfg.peft.dropout,
              "train_vision": t.vision.train, "train_projector": t.projector.train,
              "train_language_model": t.language_model.train},
        attention=resolve_attention(t.packed_attention, batching=cfg.collator.batching,
                                    attn_implementation=cfg.model.attn_implementation).description,
        engine={"name": backend.engine, "description": engine_cls.describe(engine_cfg), "settings": asdict(engine_cfg)},
        evaluation={"benchmarks": list(ev.benchmarks) if (t.eval_before or t.eval_after) else [],
                    "context_length": ev.generation.context_length, "before": t.eval_before, "after": t.eval_after},
    )


def plan_run(
    overrides: Sequence[str],
    *,
    num_gpus: Optional[int] = 8,
    gpu: str = "a100-80g",
    utilization: float = 0.35,
    accelerate_config: Optional[str] = None,
    allow_skipped: bool = False,
    skip_data: bool = False,
) -> RunPlan:
    """Resolve one run and estimate it. Raises :class:`PlanError` listing every problem.

    Without ``accelerate_config``, the run is planned for the config's typed ``launcher`` key
    (the accelerate config file its experiment's command launches with), so the memory figure
    is the one of the command that runs it; the plan says which launcher it used or assumed.
    ``num_gpus=None`` takes the launcher's process count (8 when it gives none).
    """
    from mmtune.training.loss import describe, planned_loss_impl
    from mmtune.training.sequence_parallel.groups import size_problems

    if gpu not in GPU_TYPES:
        raise PlanError(f"unknown GPU type {gpu!r}; known: {', '.join(GPU_TYPES)}")
    cfg = _composed(overrides)
    problems: list[str] = []
    params = data = None
    try:
        params = count_parameters(cfg.model, cfg.peft, cfg.training)
    except PlanError as err:
        problems.append(str(err))
    original = _original_window(cfg)
    # The trainer's sample budget: the context window when the context group sets one (it
    # overrides collator.max_length when the trainer connects the data module), else the
    # collator's own budget, as SFTRecipe.setup takes it.
    window = int(cfg.context.max_length or cfg.collator.max_length)
    if not skip_data:
        try:
            tpi = params.image_tokens if params and params.image_tokens else None
            data = plan_data(cfg.data, tpi, max_length=window, allow_skipped=allow_skipped,
                             image_limits=cfg.model.image_limits)
        except PlanError as err:
            problems.append(str(err))
    num_gpus, origin = _distributed(cfg, accelerate_config, num_gpus, problems)
    problems += size_problems(cfg.training.sequence_parallel.size, num_gpus)
    if problems:
        raise PlanError(f"run [{' '.join(overrides)}]:\n" + "\n".join(problems))

    batching, steps, micro_tokens = _batching(cfg, data, num_gpus, window)
    factor = None
    if cfg.context.max_length and original and cfg.context.rope_scaling != "none":
        factor = max(1.0, cfg.context.max_length / original)
    loss_line = f"training.loss_impl={cfg.training.loss_impl} (not resolved: the model could not be planned)"
    cost = None
    if params is not None and data is not None:
        try:  # the training loop's own resolution and fallbacks, for CUDA GPUs
            loss = planned_loss_impl(cfg, meta_model(cfg.model)[0])
        except ValueError as err:
            raise PlanError(f"run [{' '.join(overrides)}]:\n{err}") from err
        loss_line = describe(loss.impl, cfg.training.loss_chunk_size) + (f"; {loss.reason}" if loss.reason else "")
        cost = _cost(cfg, params, data, batching, steps=steps, micro_tokens=micro_tokens, num_gpus=num_gpus, gpu=gpu,
                     utilization=utilization, loss_impl=loss.impl)
    sections = _sections(cfg)
    sections["engine"].update(num_gpus=num_gpus, origin=origin)
    return RunPlan(
        overrides=list(overrides), run_name=cfg.run_name, output_dir=cfg.training.output_dir,
        params=asdict(params) if params else None, data=asdict(data) if data else None,
        context={"max_length": cfg.context.max_length, "rope_scaling": cfg.context.rope_scaling,
                 "original": original, "factor": factor},
        batching=batching, loss=loss_line, cost=asdict(cost) if cost else None, **sections)

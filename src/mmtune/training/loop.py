"""The SFT recipe: ``setup → train → save → cleanup`` over accelerate, readable top to bottom.

Why accelerate directly and not transformers' ``Trainer``: two things this project
must get exactly right are awkward to reach inside ``Trainer``.

1. *Exact resume of an index-level batch plan.* Our batches (token budgets, packing)
   are planned from sample lengths before training; resuming means recomputing the
   plan and skipping the consumed micro-batches without loading them. ``Trainer``
   owns its DataLoader/sampler and resumes by replaying batches.
2. *Token-weighted loss across micro-batches and ranks.* A multi-turn dialogue has
   very different numbers of loss tokens per sample; averaging per micro-batch (what
   a plain ``loss.mean()`` + gradient accumulation does) gives short samples in a
   batch the weight of long ones. Here the optimizer step minimises

       sum of per-token losses over every micro-batch of the step on every rank
       ---------------------------------------------------------------------
                   total loss tokens of the step on every rank

   The global token count is all-reduced before the step's first backward; each
   micro-batch's *summed* loss is scaled by ``world_size * accum / global_tokens``.
   the engine divides by ``accum`` and averages gradients over
   ``world_size`` ranks, so the gradient is exactly that of the token-weighted mean.
   Every rank runs exactly ``accum`` micro-batches per step: where an epoch's plan runs
   out (an uneven last round, a partial last step) the data module tops ranks up with
   filler micro-batches that have no loss token, so they add nothing to either sum.
   With sequence parallelism (``training.sequence_parallel.size = N``) the ``N`` ranks of a
   group hold the same rows, each computing its shard's summed loss: the token count is
   divided by ``N`` (each row counted once), and the ranks' gradients, averaged over
   ``world_size`` by DDP, add up to those of the rows (``mmtune.training.sequence_parallel``).

The distributed engine (``training.backend.engine``, replicated or sharded) is one
object behind :class:`~mmtune.training.engines.base.Engine`: it wraps or shards the model,
syncs and clips gradients, saves and loads the resumable state and gathers ``final/``; the
loop never asks which engine it runs under. accelerate still does what it does well:
device placement, mixed precision, counting the accumulation, and save/load of the
scheduler and RNG state.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from mmtune.io.disk import disk_full_guard
from mmtune.io.nofollow import open_output
from mmtune.training.checkpoint import (TRAINER_STATE, CheckpointManager, ResumeConfigError, check_output_dir,
                                       complete_checkpoints, earlier_run, intact_note, read_trainer_state,
                                       recover_interrupted_saves, save_final)
from mmtune.training.config import SFTConfig
from mmtune.training.engines import build_engine
from mmtune.training.logging import RunLogger, cut_jsonl_after, mfu
from mmtune.training.loss import TrainingLoss
from mmtune.training.manifest import choose_resume_checkpoint_once
from mmtune.training.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from mmtune.training.objective import TokenWeightedCrossEntropy, VisionOnEveryRank

__all__ = ["SFTRecipe", "seed_everything", "generate_synthetic_data", "check_evaluation_layout",
           "check_resume_layout"]

def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def generate_synthetic_data(syn: Any) -> None:
    """Write the synthetic dataset into ``syn.out_dir`` unless it is already there."""
    from mmtune.data.synthetic import generate_synthetic

    if all((Path(syn.out_dir) / name).is_file() for name in ("train.json", "test.json", "llava.json")):
        return
    generate_synthetic(syn.out_dir, n_train=syn.n_train, n_test=syn.n_test, n_llava=syn.n_llava, seed=syn.seed,
                       image_size=syn.image_size, **dict(syn.options))


def check_evaluation_layout(training: Any, engine: Any, *, num_processes: int) -> None:
    """Refuse in-training evaluation where the engine cannot generate (sharded weights on several ranks).

    Evaluation during training generates on every rank, each its own share of the
    dialogues (:mod:`mmtune.evaluation.generation.data_parallel`), so ranks make different
    numbers of forward passes; an engine that gathers sharded weights in every forward
    says why it cannot (:meth:`~mmtune.training.engines.base.Engine.evaluation_problem`).

    Raises:
        ValueError: naming the keys to change, at start-up rather than after training.
    """
    asked = [key for key in ("eval_before", "eval_after") if getattr(training, key)]
    problem = engine.evaluation_problem(num_processes) if asked else ""
    if problem:
        raise ValueError(
            f"training.{' and training.'.join(asked)}=true cannot run under {problem}. Or set "
            + " ".join(f"training.{k}=false" for k in asked) + " to train without it")


def check_resume_layout(checkpoint: Any, state: dict[str, Any], engine: Any, *, num_processes: int,
                        processes_per_rank: int, accumulation: int) -> str:
    """Refuse a resume whose rank layout cannot continue the checkpoint's exactly, before anything loads.

    A checkpoint continues on another number of processes when the engine can load its
    state there (:meth:`~mmtune.training.engines.base.Engine.reshard_problem`) and the
    data position keeps its global batch, ranks x gradient accumulation
    (:func:`~mmtune.data.datamodule.layout_problem`).

    Args:
        state: the checkpoint's ``trainer_state.json``.
        processes_per_rank: processes sharing one data rank (``training.sequence_parallel.size``).

    Returns:
        A line saying how the layout changed (empty when it did not).

    Raises:
        ResumeConfigError: one message with every problem and its fix.
    """
    from mmtune.data.datamodule import layout_problem

    data = state.get("data")
    if data is None:  # nothing recorded to compare with
        return ""
    saved_ranks = int(data.get("world_size", num_processes // processes_per_rank))
    saved_processes = int(state.get("num_processes", saved_ranks * processes_per_rank))
    ranks = num_processes // processes_per_rank
    problems = [problem for problem in (
        engine.reshard_problem(saved_processes, num_processes),
        layout_problem(data, ranks, accumulation, processes_per_rank=processes_per_rank)) if problem]
    if problems:
        raise ResumeConfigError(f"cannot resume from {checkpoint} (step {state.get('step')}) on {num_processes} "
                                f"process(es): " + "; ".join(problems))
    saved_accumulation = data.get("accumulation", accumulation)
    if (saved_ranks, saved_accumulation) == (ranks, accumulation):
        return ""
    return (f"resuming on {ranks} rank(s) x {accumulation} micro-batch(es) per step, saved on {saved_ranks} x "
            f"{saved_accumulation}: the same {ranks * accumulation} micro-batches per optimizer step, so every step "
            "trains the samples of the uninterrupted run")


def _refuse_sequence_parallel_heads(model_cfg: Any, adapter: Any, size: int) -> None:
    """Refuse a sequence-parallel size the model's heads do not divide by, before its weights load."""
    from mmtune.training.sequence_parallel.groups import planned_head_problems

    problems = planned_head_problems(model_cfg, adapter, size)
    if problems:
        raise ValueError("training.sequence_parallel cannot run: " + "; ".join(problems) + "; choose a size that "
                         "divides them")


class SFTRecipe:
    """One supervised fine-tuning run built from an :class:`SFTConfig`.

    Example::

        recipe = SFTRecipe(cfg)
        recipe.setup()
        recipe.train()
        recipe.save()
        recipe.cleanup()
    """

    def __init__(self, cfg: SFTConfig, *, resolved_config: Optional[dict[str, Any]] = None):
        self.cfg = cfg
        self.resolved_config = resolved_config if resolved_config is not None else _to_dict(cfg)
        self.output_dir = Path(cfg.training.output_dir)
        self.step = 0
        self.epoch = 0
        self.micro_batches_done = 0  # within the current epoch, on this rank
        self.context_extension = None
        self.eval_results: dict[str, Any] = {}
        self.output_lock = None  # held by the main process from setup() to cleanup()
        self.resume_from: Optional[Path] = None
        self.config_changes: list[dict[str, Any]] = []  # allowed changes on every resume so far
        self.resume_changes: dict[str, Any] = {}  # those of this resume

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Build the run in the order its parts depend on; restore a checkpoint when resuming.

        The engine comes first (it chooses the accelerator's plugin), then the output folder
        is claimed. A resume is checked against the checkpoint's config and data before
        anything is built, so a refused one stops at once. The engine shards the model
        before the optimizer takes its parameters; the scheduler's length is the data
        plan's; the engine wraps model, optimizer and scheduler together, and a checkpoint
        is loaded into what it wrapped.
        """
        self._start_engine()
        seed_everything(self.cfg.training.seed)
        self._claim_output_dir()
        self._prepare_data_files()
        self._choose_resume()
        model, groups = self._build_model()
        model, optimizer = self._build_optimizer(model, groups)
        self._build_data()
        scheduler = self._build_scheduler(optimizer)
        self._wrap(model, optimizer, scheduler, groups)
        self._restore()
        self._start_logger()

    def _start_engine(self) -> None:
        """The engine chosen by ``training.backend.engine`` and the accelerator it configures."""
        from accelerate import Accelerator

        t = self.cfg.training
        self.engine = build_engine(self.cfg)
        self.accelerator = Accelerator(
            mixed_precision=t.mixed_precision,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            # We step the scheduler once per optimizer step ourselves; accelerate's default
            # would step it once per process per step.
            step_scheduler_with_optimizer=False,
            # The engine's own (its plugin, its wrapper's options; cpu=True without a GPU so
            # that several torchrun processes run as MULTI_CPU on gloo).
            **self.engine.accelerator_kwargs(),
        )
        acc = self.accelerator
        self.engine.start(acc)  # a launch for another engine stops here, naming both
        check_evaluation_layout(t, self.engine, num_processes=acc.num_processes)
        acc.print(f"engine: {self.engine.describe(self.engine.config)} on {acc.num_processes} process(es)")

    def _claim_output_dir(self) -> None:
        """Lock ``training.output_dir``, finish saves an earlier attempt left half-renamed, and refuse
        a folder with checkpoints unless resuming."""
        acc = self.accelerator
        self._lock_output_dir()
        if acc.is_main_process:
            recover_interrupted_saves(self.output_dir)  # a save killed between its renames
        acc.wait_for_everyone()
        self._check_output_dir()

    def _prepare_data_files(self) -> None:
        """The data files (generated when synthetic) and their content identities.

        This comes before :meth:`_choose_resume`, so that a resume compares the data's content too.
        """
        acc = self.accelerator
        if self.cfg.synthetic.enabled:
            if acc.is_main_process:
                generate_synthetic_data(self.cfg.synthetic)
            acc.wait_for_everyone()
        self.data_identities = self._data_identities()

    def _choose_resume(self) -> None:
        """Pick the checkpoint to resume from and check this run's config against its own.

        Before building anything: a resume with a changed config is refused at once. The
        checkpoint is the newest whose files are all there (:mod:`mmtune.training.manifest`).
        """
        t = self.cfg.training
        self.resume_from, passed_over = choose_resume_checkpoint_once(  # verified by the main process
            self.accelerator, t.resume, lambda: complete_checkpoints(self.output_dir),
            lambda c: read_trainer_state(c).get("step"))
        if passed_over:
            self.accelerator.print(passed_over)
        self.config_changes = self._check_resume_config() if self.resume_from is not None else []

    def _build_model(self) -> tuple[torch.nn.Module, Any]:
        """Load the model through the adapter, extend its context, apply LoRA, freeze, choose attention.

        Returns:
            The model (unwrapped) and its module groups (the adapter's ``module_groups``).

        Raises:
            ValueError: when the training window exceeds the model's context window.
        """
        from mmtune.models.registry import build_adapter
        from mmtune.models.rope import apply_context_extension
        from mmtune.training.optim import apply_freezing
        from mmtune.training.peft_setup import apply_lora, qlora_load_kwargs

        cfg, t = self.cfg, self.cfg.training
        # Random-weight models are seeded identically on every rank.
        self.adapter = build_adapter(cfg.model)
        if t.sequence_parallel.size > 1:  # the heads split over the group, from the config alone
            _refuse_sequence_parallel_heads(cfg.model, self.adapter, t.sequence_parallel.size)
        load_kwargs: dict[str, Any] = {"seed": t.seed} if cfg.model.path is None else {}
        if cfg.peft.method == "qlora":
            load_kwargs.update(qlora_load_kwargs(cfg.peft, torch.bfloat16 if t.mixed_precision == "bf16" else torch.float16,
                                                  skip_modules=self.adapter.quantization_skip_modules()))
        model = self.adapter.load_model(**load_kwargs)
        text_config = self.adapter.text_config(model.config)
        self.context_extension = apply_context_extension(
            model, text_config, cfg.context,
            model_max_position_embeddings=cfg.model.max_position_embeddings, tokenizer=self.adapter.tokenizer)
        # The training window: the context group's target when it extends the model,
        # otherwise the collator's sample budget.
        self.max_length = cfg.context.max_length or cfg.collator.max_length
        window = max(int(text_config.max_position_embeddings),
                     self.context_extension.target if self.context_extension else 0)  # dynamic NTK keeps the original
        if self.max_length > window:
            raise ValueError(
                f"samples of up to {self.max_length} tokens (collator.max_length / context.max_length) exceed the "
                f"model's {window}-token window: lower collator.max_length or extend the window with context=8k")
        if t.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        lora = cfg.peft.method in ("lora", "qlora")
        if lora:
            model = apply_lora(model, self.adapter.module_groups(model), cfg.peft, self.adapter.default_lora_targets,
                               gradient_checkpointing=t.gradient_checkpointing)
        groups = self.adapter.module_groups(model)
        apply_freezing(model, groups, t, lora=lora)
        self._choose_attention(model, text_config)
        self.sequence_parallel = None
        if t.sequence_parallel.size > 1:
            from mmtune.training.sequence_parallel import SequenceParallel

            self.sequence_parallel = SequenceParallel.create(t.sequence_parallel.size, self.adapter, model,
                                                             attn_implementation=text_config._attn_implementation)
        return model, groups

    def _build_optimizer(self, model: torch.nn.Module, groups: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Count the parameters, let the engine shard the model, then build the optimizer over its groups.

        Returns:
            The model as the engine sharded it, and the optimizer over its parameters.
        """
        from mmtune.training.optim import build_optimizer, param_groups

        t = self.cfg.training
        self.num_params, self.num_trainable = self.engine.parameter_counts(model)
        model = self.engine.shard(model, groups)  # before the optimizer takes the parameters
        self.optim_groups = param_groups(model, groups, t)
        return model, build_optimizer(self.optim_groups, t)

    def _build_data(self) -> None:
        """The data module, its report of what it left out, and the run's optimizer steps.

        Every epoch has its own plan (packing and token budgets differ from epoch to epoch),
        padded per rank to whole optimizer steps, so no step straddles two epochs and every
        rank runs the same micro-batches per step and the same steps.
        """
        from mmtune.data.datamodule import SFTDataModule

        cfg, t, acc = self.cfg, self.cfg.training, self.accelerator
        # The data module plans for the data-parallel ranks: every rank of a sequence-parallel group gets one plan.
        sp_size = t.sequence_parallel.size
        self.data = SFTDataModule(cfg.data, cfg.collator, seed=t.seed, num_workers=t.num_workers)
        self.data.connect(self.adapter, max_length=cfg.context.max_length, rank=acc.process_index // sp_size,
                          world_size=acc.num_processes // sp_size,
                          gradient_accumulation_steps=t.gradient_accumulation_steps)
        self.data.setup()
        if acc.is_main_process:  # what the data pipeline left out, per source and reason
            self.output_dir.mkdir(parents=True, exist_ok=True)
            report = self.output_dir / "data_report.json"
            with disk_full_guard(report, "data_report.json", intact=lambda: intact_note(self.output_dir)):
                self.data.loss_report.write(str(report))
        acc.print(self.data.loss_report.render())
        self.total_steps = self._count_steps()

    def _build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """The learning-rate schedule over the run's optimizer steps (so after :meth:`_build_data`)."""
        from transformers import get_scheduler

        t = self.cfg.training
        warmup = t.warmup_steps if t.warmup_steps is not None else math.ceil(t.warmup_ratio * self.total_steps)
        return get_scheduler(t.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=self.total_steps)

    def _wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, groups: Any) -> None:
        """Let the engine wrap model, optimizer and scheduler; build the loss and the objective on the wrapped model."""
        t, acc = self.cfg.training, self.accelerator
        self.model, self.optimizer, self.scheduler = self.engine.prepare(model, optimizer, scheduler)
        self.loss = TrainingLoss(self.adapter, self.model, impl=t.loss_impl, chunk_size=t.loss_chunk_size,
                                 device=acc.device, engine=self.engine)
        self.vision = VisionOnEveryRank(self.adapter, self.model, groups.language_model)
        self.objective = TokenWeightedCrossEntropy(
            self.batch_loss, reduce_sum=lambda x: acc.reduce(x, reduction="sum"), world_size=acc.num_processes,
            accumulation=t.gradient_accumulation_steps, device=acc.device, row_replicas=t.sequence_parallel.size)
        acc.print(f"loss: {self.loss.description}")
        acc.print(f"attention: {self.attention.description}")
        if self.sequence_parallel is not None:
            acc.print(self.sequence_parallel.description)
        if t.compile:
            self.model = torch.compile(self.model)

    def _restore(self) -> None:
        """Load the chosen checkpoint (:meth:`_choose_resume`) into the wrapped run, or start the logs afresh.

        Raises:
            ResumeConfigError: when the checkpoint's data plan does not match this run's data.
        """
        acc = self.accelerator
        self.checkpoints = CheckpointManager(self.output_dir, keep_last=self.cfg.training.keep_last)
        self.nonfinite = NonFiniteGuard(self.cfg.training.max_nonfinite_steps,
                                        loss_scaled=self.cfg.training.mixed_precision == "fp16")
        resume_from = self.resume_from
        if resume_from is None and acc.is_main_process:
            # A fresh run: per-step logs from an earlier attempt in this directory would mix in.
            for stale in ("metrics.jsonl", "sample_ids.jsonl"):
                (self.output_dir / stale).unlink(missing_ok=True)
        if resume_from is not None:
            saved = read_trainer_state(resume_from)
            try:  # before anything loads
                self.data.check_state(saved["data"], processes_per_rank=self.cfg.training.sequence_parallel.size)
            except ValueError as err:  # a resume refusal like a changed config: one message, no traceback
                raise ResumeConfigError(f"cannot resume from {resume_from} (step {saved['step']}): {err}") from None
            # This run's optimizer settings, before the checkpoint's replace them (see _apply_allowed_changes).
            fresh = ([{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
                     list(self.scheduler.scheduler.base_lrs))
            state = self.checkpoints.load(acc, resume_from, engine=self.engine)
            if self.resume_changes:
                self._apply_allowed_changes(*fresh)
            self.step, self.epoch = int(state["step"]), int(state["epoch"])
            # The saved position dealt out to this run's ranks (the same when the layout is the checkpoint's).
            self.micro_batches_done = self.data.resume_position(state["data"])
            # accelerate finds each step's last micro-batch by counting micro-batches; it restored
            # the saved rank's count, which under another accumulation falls elsewhere in a step.
            acc.step = self.step * self.cfg.training.gradient_accumulation_steps
            self._note_random_states(state)
            if acc.is_main_process:
                # Steps after the checkpoint were logged by the interrupted attempt and are
                # about to be trained again: drop their rows so each step appears once.
                for log in ("metrics.jsonl", "sample_ids.jsonl"):
                    cut_jsonl_after(self.output_dir / log, self.step)
            acc.print(f"resumed from {resume_from}: step {self.step}, epoch {self.epoch}, "
                      f"micro-batch {self.micro_batches_done} of the epoch")

    def _note_random_states(self, state: dict[str, Any]) -> None:
        """Say which processes did not get their own random state back from a checkpoint saved on another number.

        accelerate's ``load_state`` restores ``random_states_<i>.pkl`` on process ``i`` and, for
        a process without that file, logs and goes on: its Python, NumPy and torch generators
        keep the state they reached at start-up, seeded with ``training.seed`` like every
        process of a fresh run. Files of processes this run does not have are not read.
        """
        acc = self.accelerator
        ranks = state.get("data", {}).get("world_size", acc.num_processes // self.cfg.training.sequence_parallel.size)
        saved = int(state.get("num_processes", ranks * self.cfg.training.sequence_parallel.size))
        if saved == acc.num_processes:
            return
        if acc.num_processes > saved:
            acc.print(f"random state: the checkpoint holds those of {saved} process(es); processes {saved}.."
                      f"{acc.num_processes - 1} have none and continue from their start-up state (training.seed)")
        else:
            acc.print(f"random state: processes 0..{acc.num_processes - 1} restored their own; those of processes "
                      f"{acc.num_processes}..{saved - 1} are not used")

    def _start_logger(self) -> None:
        """The run logger, from the step the run starts at, and the run's one-line summary."""
        cfg, acc = self.cfg, self.accelerator
        self.logger = RunLogger(cfg.logging, output_dir=str(self.output_dir), resolved_config=self.resolved_config,
                                is_main=acc.is_main_process, total_steps=self.total_steps, initial_step=self.step,
                                run_name=cfg.logging.run_name or cfg.run_name, secret_names=self.secret_names)
        acc.print(
            f"model: {self.num_params / 1e6:.2f}M parameters, {self.num_trainable / 1e6:.2f}M trainable; "
            f"{self.total_steps} optimizer steps ({'/'.join(map(str, self.steps_per_epoch))} per epoch) "
            f"on {acc.num_processes} process(es); "
            f"window {self.max_length} tokens"
            + (f" ({self.context_extension.rope_type} RoPE x{self.context_extension.factor:g})"
               if self.context_extension else "")
        )

    def _choose_attention(self, model: torch.nn.Module, text_config: Any) -> None:
        """Resolve ``training.packed_attention`` against the loaded model (see
        :mod:`mmtune.training.packed_attention`); ``auto`` falls back, saying why, where the
        language model cannot switch, ``per_sample`` fails."""
        from mmtune.training.packed_attention import fallback, language_model, model_support_problem, resolve_attention

        mode = self.cfg.training.packed_attention
        self.attention = resolve_attention(mode, batching=self.cfg.collator.batching,
                                           attn_implementation=text_config._attn_implementation)
        self._language_model = language_model(model, text_config)
        if self.attention.per_sample:
            problem = model_support_problem(model, text_config)
            if problem and mode == "per_sample":
                raise ValueError(f"training.packed_attention=per_sample cannot work with this model: {problem}; "
                                 "set training.packed_attention=auto (transformers' block mask) or off")
            if problem:
                self.attention = fallback(self.attention, problem)

    def _count_steps(self) -> int:
        """Optimizer steps of the run: the sum over every epoch's own plan, capped by max_steps."""
        t = self.cfg.training
        self.steps_per_epoch: list[int] = []
        for epoch in range(t.epochs):
            if t.max_steps is not None and sum(self.steps_per_epoch) >= t.max_steps:
                break  # later epochs are never reached; no need to plan them
            self.steps_per_epoch.append(self.data.steps_in_epoch(epoch))
        total = sum(self.steps_per_epoch)
        if total == 0:
            raise ValueError("the batch plan is empty: no sample of data.mixture fits collator.max_length "
                             "(see the truncation stats) or the sources have no records")
        return min(total, t.max_steps) if t.max_steps is not None else total

    def _lock_output_dir(self) -> None:
        """Refuse a second job writing into this run's folder (every rank stops with the holder's details).

        Only the main process takes the lock: every rank of this job writes into the folder
        (its RNG state, its engine's shards), which is legitimate. Another job's main process
        then finds it held; the refusal is broadcast so that its other ranks stop at once
        with the same message instead of waiting at the next barrier.
        """
        from accelerate.utils import broadcast_object_list

        from mmtune.io.locks import DirectoryLockedError, lock_directory

        acc, refusal = self.accelerator, None
        if acc.is_main_process:
            try:
                self.output_lock = lock_directory(
                    self.output_dir, purpose="training",
                    hint="set training.output_dir to another folder (to continue that run once it has stopped, "
                         "rerun with training.resume=auto)")
            except DirectoryLockedError as err:
                refusal = str(err)
        if acc.num_processes > 1:
            refusal = broadcast_object_list([refusal])[0]
        if refusal is not None:
            raise DirectoryLockedError(refusal)

    def _check_resume_config(self) -> list[dict[str, Any]]:
        """The config changes of the run so far, this resume's included; refuses one not allowed.

        First the rank layout (:func:`check_resume_layout`: the engine loads the state on this
        number of processes, and ranks x gradient accumulation is the checkpoint's), then this
        run's config against the one the checkpoint was saved with (see
        :func:`~mmtune.training.checkpoint.check_resume_config`). Returns the checkpoint's
        record of earlier changes plus this resume's, if any: ``{"effective_from_step",
        "resumed_from", "changes": {key: {"old", "new"}}}``.
        """
        from mmtune.data.datamodule import saved_global_batch
        from mmtune.data.identity import comparable_record
        from mmtune.training.checkpoint import check_resume_config

        if not (Path(self.resume_from) / TRAINER_STATE).is_file():
            raise FileNotFoundError(
                f"training.resume: {self.resume_from} has no {TRAINER_STATE}, so it is not a complete mmtune "
                "checkpoint; name a <output_dir>/checkpoints/step-N folder, or use training.resume=auto")
        state = read_trainer_state(self.resume_from)
        t, acc = self.cfg.training, self.accelerator
        layout_change = check_resume_layout(self.resume_from, state, self.engine, num_processes=acc.num_processes,
                                            processes_per_rank=t.sequence_parallel.size,
                                            accumulation=t.gradient_accumulation_steps)
        if layout_change:
            acc.print(layout_change)
        # The layout check compared ranks x accumulation, so the accumulation alone may differ.
        free = ({"training.gradient_accumulation_steps": "the same global batch on another number of ranks"}
                if saved_global_batch(state.get("data", {})) is not None else {})
        history = list(state.get("config_changes", []))
        if "config" not in state:
            self.accelerator.print(f"note: {self.resume_from} does not record its run's config (saved by an older "
                                   "mmtune), so changes to it cannot be checked")
            return history
        current, unchecked = comparable_record(state["config"], self.config_record())
        if unchecked:
            self.accelerator.print(f"{self.resume_from}: {unchecked}")
        changes = check_resume_config(self.resume_from, state, current, list(t.resume_config_changes), free=free)
        self.resume_changes = changes
        if changes:
            step = int(state["step"])
            history.append({"effective_from_step": step + 1, "resumed_from": str(self.resume_from), "changes": changes})
            self.accelerator.print(
                f"resuming with config changes allowed by training.resume_config_changes, from step {step + 1}: "
                + "; ".join(f"{key}: {c['old']!r} -> {c['new']!r}" for key, c in changes.items()))
        return history

    def _apply_allowed_changes(self, fresh_groups: list[dict[str, Any]], fresh_base_lrs: list[float]) -> None:
        """Make allowed changes of the optimizer and schedule take effect after a checkpoint load.

        Loading restores the optimizer's param-group settings (lr, weight decay, betas,
        epsilon) and the scheduler's base learning rates from the checkpoint, so without
        this a changed ``training.lr`` would be recorded but never used. The moments and
        the step count stay the checkpoint's; the schedule's shape (type, warm-up, length)
        is already this run's, since the scheduler was built from this config.
        """
        scheduler = self.scheduler.scheduler  # transformers' schedulers are LambdaLR
        scheduler.base_lrs = list(fresh_base_lrs)
        for group, fresh, base, factor in zip(self.optimizer.param_groups, fresh_groups, scheduler.base_lrs,
                                              scheduler.lr_lambdas):
            for key in ("weight_decay", "betas", "eps", "initial_lr"):
                if key in fresh:
                    group[key] = fresh[key]
            group["lr"] = base * factor(scheduler.last_epoch)

    @property
    def secret_names(self) -> list[str]:
        """Environment variables holding secrets whatever their names (the judge's key variable)."""
        return [self.cfg.eval.judge.api_key_env]

    def config_record(self) -> dict[str, Any]:
        """This run's typed config, secrets redacted, as JSON would give it back: what checkpoints record."""
        from mmtune.data.identity import with_identities
        from mmtune.io.secrets import redact

        record = json.loads(json.dumps(redact(_to_dict(self.cfg), names=self.secret_names), default=str))
        return with_identities(record, getattr(self, "data_identities", None))

    def _data_identities(self) -> list[str]:
        """Each data source's content identity (:mod:`mmtune.data.identity`): read once, by the main
        process, and given to every rank."""
        from accelerate.utils import broadcast_object_list

        from mmtune.data.identity import source_identities

        acc = self.accelerator
        identities = source_identities(self.cfg.data.mixture.sources) if acc.is_main_process else None
        if acc.num_processes > 1:
            identities = broadcast_object_list([identities])[0]
        return identities

    def _check_output_dir(self) -> None:
        """A fresh run into a used folder is refused, or clears it with training.overwrite_output_dir."""
        t, acc = self.cfg.training, self.accelerator
        earlier = earlier_run(self.output_dir) if t.resume is None else []  # every rank: each raises alike
        if earlier and acc.is_main_process:
            acc.print(check_output_dir(self.output_dir, resume=t.resume, overwrite=t.overwrite_output_dir))
        elif earlier and not t.overwrite_output_dir:
            check_output_dir(self.output_dir, resume=t.resume, overwrite=False)
        acc.wait_for_everyone()

    # ------------------------------------------------------------------ train
    def _micro_batches(self) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        """Micro-batches from the resume position onwards, epoch after epoch.

        Every epoch's plan holds whole steps (see ``SFTDataModule.rank_plan``), so a step
        never mixes two epochs.
        """
        epoch, start = self.epoch, self.micro_batches_done
        while True:
            for index, item in enumerate(self.data.dataloader(epoch, start=start), start=start):
                self.epoch, self.micro_batches_done = epoch, index + 1
                yield item
            epoch, start = epoch + 1, 0
            self.epoch, self.micro_batches_done = epoch, 0

    def train(self) -> None:
        """Run optimizer steps until ``total_steps``, checkpointing every ``save_every_steps``."""
        if self.cfg.training.eval_before and self.step == 0:
            self.eval_results["before"] = self.evaluate(tag="before")
        self.grad_norm = None
        self.model.train()
        with self._training_attention():
            self._train_steps()
        self._report_skipped()

    def _training_attention(self) -> contextlib.AbstractContextManager:
        """The training steps' attention (per sample over packed rows when chosen); evaluation
        and generation outside them keep ``model.attn_implementation``."""
        from mmtune.training.packed_attention import use_attention

        if not self.attention.per_sample or self.sequence_parallel is not None:  # SP sets its own per step
            return contextlib.nullcontext()
        return use_attention(self._language_model, self.attention.training_implementation)

    def _train_steps(self) -> None:
        acc, t, cfg, engine = self.accelerator, self.cfg.training, self.cfg, self.engine
        accum = t.gradient_accumulation_steps
        batches = self._micro_batches()
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        while self.step < self.total_steps:
            started = time.perf_counter()
            micro = [next(batches) for _ in range(accum)]
            # Global loss-token count of this step, before any backward (see module docstring).
            global_tokens = self.objective.begin_step([b for b, _ in micro])
            sp_size = t.sequence_parallel.size  # ranks holding each micro-batch: its tokens and images count once
            loss_sum = torch.zeros((), device=acc.device)
            seq_tokens = images = 0
            for batch, meta in micro:
                with engine.accumulate(self.model):
                    scaled, summed = self.objective(batch)
                    engine.backward(scaled)
                    if engine.sync_gradients:
                        # Without clipping (max_grad_norm unset) this only measures the norm.
                        self.grad_norm = engine.clip_grad_norm(self.model, t.max_grad_norm)
                        if self.nonfinite.allows_update(self.grad_norm):  # a NaN update is never applied
                            self.optimizer.step()
                        self.scheduler.step()  # ours, once per optimizer step, whatever the engine
                        self.optimizer.zero_grad(set_to_none=True)
                loss_sum += summed.detach()
                self.data.note_skipped(meta)
                seq_tokens += meta["tokens"]
                images += meta["images"]
            self.step += 1
            # each rank's loss_sum is its shard's (they add up to the rows'); tokens and images are the rows'
            stats = acc.reduce(torch.tensor([float(loss_sum), seq_tokens / sp_size, images / sp_size],
                                            device=acc.device), reduction="sum")
            elapsed = time.perf_counter() - started
            if t.log_sample_ids:
                self._log_sample_ids([meta["ids"] for _, meta in micro], epoch=self.epoch)
            self._check_finite(float(stats[0]), [meta["ids"] for _, meta in micro])
            if self.step % cfg.logging.every_steps == 0 or self.step == self.total_steps:
                tokens_per_s = float(stats[1]) / elapsed
                metrics = {
                    "train/loss": self.objective.step_loss(float(stats[0])),
                    "train/lr": self.scheduler.get_last_lr()[0],
                    "train/loss_tokens": global_tokens,
                    "train/epoch": self.epoch + self.micro_batches_done / self.data.num_micro_batches(self.epoch),
                    "perf/tokens_per_s": tokens_per_s,
                    "perf/images_per_s": float(stats[2]) / elapsed,
                    "perf/step_time_s": elapsed,
                }
                for group, lr in zip(self.optim_groups, self.scheduler.get_last_lr()):
                    metrics[f"train/lr/{group['name']}"] = lr
                if self.grad_norm is not None:
                    metrics["train/grad_norm"] = float(self.grad_norm)
                util = mfu(self.num_params, tokens_per_s, device_name, acc.num_processes)
                if util is not None:
                    metrics["perf/mfu"] = util
                self.logger.log(self.step, metrics)
            self.logger.advance()
            if t.save_every_steps and self.step % t.save_every_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint()

    def _check_finite(self, loss_sum: float, ids: list[list[str]]) -> None:
        """Count a step whose loss or gradient norm is not finite; stop past ``training.max_nonfinite_steps``
        (:mod:`mmtune.training.nonfinite`), every rank at once with the step's ids from every rank."""
        from accelerate.utils import gather_object

        loss = self.objective.step_loss(loss_sum)
        bad = not (math.isfinite(loss) and self.nonfinite.allows_update(self.grad_norm))  # the same on every rank
        if bad and self.accelerator.num_processes > 1:
            ids = [batch for rank in gather_object([ids]) for batch in rank]
        note = self.nonfinite.observe(self.step, loss, self.grad_norm, ids)
        if note:
            self.accelerator.print(note)

    def batch_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """The summed next-token loss of one micro-batch (fp32 scalar), under autocast (the
        objective's loss, :class:`~mmtune.training.objective.TokenWeightedCrossEntropy`).

        The batch's model inputs (the adapter's image inputs and position layout among them)
        pass to the forward by name (:func:`~mmtune.data.collator.forward_inputs`)."""
        from mmtune.data.collator import forward_inputs

        acc = self.accelerator
        inputs = {k: v.to(acc.device) if v is not None else None for k, v in forward_inputs(batch).items()}
        # Text-only batch: the vision tower still runs, inside the forward where images would
        # (sharded engines gather its weights from every rank there); its value is exactly 0.
        text_only = all(inputs.get(name) is None for name in self.adapter.image_input_names)
        with acc.autocast(), self.vision.armed(text_only):
            if self.sequence_parallel is not None:  # this rank's shard of the rows, its shifted targets
                with self.sequence_parallel.step(self.model, inputs, batch["labels"].to(acc.device)) as targets:
                    summed = self.loss(self.model, inputs, targets, shifted=True)
            else:
                summed = self.loss(self.model, inputs, batch["labels"])
        return summed + self.vision.take()

    def _report_skipped(self) -> None:
        """Samples dropped while loading (images that failed to decode, skip mode): printed and in data_report.json."""
        from accelerate.utils import gather_object

        acc = self.accelerator
        items = self.data.skipped_items
        if acc.num_processes > 1:
            items = gather_object(items)
        if acc.is_main_process and items:
            self.data.merge_skipped(items)
            self.data.loss_report.write(str(self.output_dir / "data_report.json"))
            acc.print(self.data.loss_report.render_skipped())

    def _log_sample_ids(self, ids_per_micro_batch: list[list[str]], *, epoch: int) -> None:
        from accelerate.utils import gather_object

        gathered = gather_object([{"rank": self.accelerator.process_index, "ids": ids_per_micro_batch}])
        if self.accelerator.is_main_process:
            path = self.output_dir / "sample_ids.jsonl"
            with disk_full_guard(path, "sample_ids.jsonl", intact=lambda: intact_note(self.output_dir)):
                with open_output(path, "a") as f:
                    f.write(json.dumps({"step": self.step, "epoch": epoch,
                                        "ranks": sorted(gathered, key=lambda r: r["rank"])}) + "\n")

    # ------------------------------------------------------------------ save
    def save_checkpoint(self) -> Optional[Path]:
        """A resumable checkpoint of the current step (atomic; keeps the last N); none after a
        non-finite step (its state would replace a good checkpoint)."""
        if self.nonfinite.save_problem():
            self.accelerator.print(f"checkpoint step {self.step} {self.nonfinite.save_problem()}")
            return None
        return self.checkpoints.save(self.accelerator, self.step, engine=self.engine, trainer_state={
            "epoch": self.epoch, "micro_batches_done": self.micro_batches_done, "total_steps": self.total_steps,
            "data": self.data.state_dict(self.epoch, self.micro_batches_done),
            "num_processes": self.accelerator.num_processes,  # what the engine's state was saved on
            # What a resume compares its own config with, and the changes made so far.
            "config": self.config_record(), "config_changes": self.config_changes,
        })

    def save(self) -> Optional[Path]:
        """Write ``final/`` (HF checkpoint + processor + mmtune_run.json); evaluate it if asked."""
        from mmtune.io.secrets import redact

        if not self.cfg.training.save_final:
            return None
        if self.nonfinite.save_problem():
            raise NonFiniteTrainingError(f"final/ {self.nonfinite.save_problem()}; rerun from the last checkpoint "
                                         "with training.resume=auto")
        metadata = {
            "family": self.cfg.model.family,
            "run": redact(self.run_name, names=self.secret_names),
            "step": self.step,
            "context_extension": asdict(self.context_extension) if self.context_extension else None,
            "max_length": self.max_length,
            "config": self.logger_config(),
        }
        if self.config_changes:  # the values above hold from these steps on; the old ones before
            metadata["config_changes"] = self.config_changes
        extras = [self.adapter] if hasattr(self.adapter, "save_pretrained") else [self.adapter.tokenizer]
        self.final_dir = save_final(self.accelerator, self.model, self.output_dir / "final",
                                    save_pretrained_extras=extras, metadata=metadata,
                                    merge_lora=self.cfg.peft.merge_on_save, engine=self.engine)
        if self.cfg.training.eval_after:
            self.eval_results["after"] = self.evaluate(tag="after", checkpoint=str(self.final_dir))
        return self.final_dir

    @property
    def run_name(self) -> str:
        return self.cfg.run_name or self.output_dir.name

    def logger_config(self) -> dict[str, Any]:
        """The resolved config as ``final/mmtune_run.json`` records it: secret keys and every secret
        value of the environment (``run_name: ${oc.env:MMTUNE_JUDGE_API_KEY}``) redacted."""
        from mmtune.io.secrets import redact

        return redact(self.resolved_config, names=self.secret_names)

    # ------------------------------------------------------------------ eval
    def evaluate(self, *, tag: str, checkpoint: Optional[str] = None) -> dict[str, Any]:
        """Run the ``eval`` benchmarks on the current model and log them: every rank generates
        its share of the dialogues, the main process scores (see ``check_evaluation_layout``)."""
        from mmtune.training.evaluation import evaluate_in_training

        acc = self.accelerator
        model = self.engine.unwrap(self.model)
        results = evaluate_in_training(model, self.adapter, self.cfg, tag=tag, run=self.run_name,
                                       output_dir=str(self.output_dir / "eval" / tag), checkpoint=checkpoint,
                                       wandb_run=self.logger.wandb_run if acc.is_main_process else None)
        if acc.is_main_process:
            flat = {f"eval_{tag}/{bench}/{name}": value for bench, metrics in results.items()
                    for name, value in metrics.items()}
            self.logger.summary(flat)
            acc.print(f"eval ({tag}): " + ", ".join(f"{k.split('/', 1)[1]}={v:.2f}" for k, v in flat.items()
                                                    if isinstance(v, (int, float))))
        acc.wait_for_everyone()
        return results

    # ------------------------------------------------------------------ cleanup
    def cleanup(self) -> None:
        self.logger.close()
        # Every rank arrives before the process group goes: a rank that tore it down while
        # another still finished its last collective would abort that one (gloo's threads).
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        # What gloo's finished work objects still hold can sit in reference cycles; freed in
        # interpreter shutdown instead, it aborts a rank whose run succeeded (SIGABRT,
        # "terminate called without an active exception", about one 2-rank CPU run in ten).
        gc.collect()
        if self.output_lock is not None:
            self.output_lock.release()


def _to_dict(cfg: SFTConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]

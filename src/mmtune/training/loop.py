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
from mmtune.training import resume as resume_policy
from mmtune.training.checkpoint import CheckpointManager, intact_note, save_final
from mmtune.training.config import SFTConfig, run_engine
from mmtune.training.layout import RankLayout
from mmtune.training.logging import RunLogger, mfu, step_metrics
from mmtune.training.loss import TrainingLoss
from mmtune.training.nonfinite import NonFiniteGuard, NonFiniteTrainingError
from mmtune.training.objective import TokenWeightedCrossEntropy, VisionOnEveryRank

__all__ = ["SFTRecipe", "seed_everything", "check_evaluation_layout"]

def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def check_evaluation_layout(training: Any, engine: Any, *, num_processes: int) -> None:
    """Refuse in-training evaluation where the engine says it cannot generate.

    Evaluation during training generates on every rank, each its own share of the
    dialogues (:mod:`mmtune.evaluation.generation.data_parallel`), so ranks make different
    numbers of forward passes; the shipped engines give each rank a model that computes
    alone (:meth:`~mmtune.training.engines.base.Engine.evaluation_model`), and an engine
    that cannot says why (:meth:`~mmtune.training.engines.base.Engine.evaluation_problem`).

    Raises:
        ValueError: naming the keys to change, at start-up rather than after training.
    """
    asked = [key for key in ("eval_before", "eval_after") if getattr(training, key)]
    problem = engine.evaluation_problem(num_processes) if asked else ""
    if problem:
        raise ValueError(
            f"training.{' and training.'.join(asked)}=true cannot run under {problem}. Or set "
            + " ".join(f"training.{k}=false" for k in asked) + " to train without it")


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
        self.resume = resume_policy.Resume()  # the checkpoint continued and its recorded config changes

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
        self.engine = run_engine(self.cfg)
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
        self.layout = RankLayout.of_run(t, num_processes=acc.num_processes, process_index=acc.process_index)
        self.engine.start(acc)  # a launch for another engine stops here, naming both
        check_evaluation_layout(t, self.engine, num_processes=acc.num_processes)
        acc.print(f"engine: {self.engine.describe(self.engine.config)} on {acc.num_processes} process(es)")

    def _claim_output_dir(self) -> None:
        """Lock ``training.output_dir``, finish half-renamed saves, refuse a used folder unless resuming."""
        t = self.cfg.training
        self.output_lock = resume_policy.claim_output_dir(self.accelerator, self.output_dir, t.resume,
                                                          overwrite=t.overwrite_output_dir)

    def _prepare_data_files(self) -> None:
        """The data files (generated when synthetic) and their content identities.

        This comes before :meth:`_choose_resume`, so that a resume compares the data's content too.
        """
        if self.cfg.synthetic.enabled:  # the demos' and the tiny runs' generated data (configs/synthetic/)
            from mmtune.training.synthetic_data import generate_synthetic_data

            generate_synthetic_data(self.cfg.synthetic, self.accelerator)
        self.data_identities = data_identities(self.accelerator, self.cfg.data.mixture.sources)

    def _choose_resume(self) -> None:
        """Pick the checkpoint to resume from and check this run against it (:mod:`mmtune.training.resume`).

        Before building anything: a resume with a changed config is refused at once.
        """
        self.resume = resume_policy.plan_resume(self.cfg.training, self.output_dir, engine=self.engine,
                                                layout=self.layout, config_record=self.config_record,
                                                accelerator=self.accelerator)

    def _build_model(self) -> tuple[torch.nn.Module, Any]:
        """The model through the adapter, with its window, LoRA, freezing, attention and sequence
        parallelism (:func:`~mmtune.training.model_setup.build_model`).

        Returns:
            The model (unwrapped) and its module groups (the adapter's ``module_groups``).
        """
        from mmtune.training.model_setup import build_model

        built = build_model(self.cfg, self.layout)
        self.adapter, self.context_extension, self.max_length = built.adapter, built.context_extension, built.max_length
        self.attention, self._language_model = built.attention, built.language_model
        self.sequence_parallel = built.sequence_parallel
        return built.model, built.groups

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
        layout = self.layout
        self.data = SFTDataModule(cfg.data, cfg.collator, seed=t.seed, num_workers=t.num_workers)
        self.data.connect(self.adapter, max_length=cfg.context.max_length, rank=layout.data_rank,
                          world_size=layout.data_ranks, gradient_accumulation_steps=layout.accumulation,
                          max_steps=t.max_steps)
        self.data.setup()
        if acc.is_main_process:  # what the data pipeline left out, per source and reason
            self.output_dir.mkdir(parents=True, exist_ok=True)
            report = self.output_dir / "data_report.json"
            with disk_full_guard(report, "data_report.json", intact=lambda: intact_note(self.output_dir)):
                self.data.loss_report.write(str(report))
        acc.print(self.data.loss_report.render())
        self.steps_per_epoch, self.total_steps = count_steps(self.data, self.cfg.training)

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
            accumulation=self.layout.accumulation, device=acc.device, row_replicas=self.layout.sequence_parallel)
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
        if self.resume.checkpoint is None:
            if acc.is_main_process:
                resume_policy.reset_step_logs(self.output_dir, None)
            return
        state = resume_policy.restore(self.resume, accelerator=acc, checkpoints=self.checkpoints, engine=self.engine,
                                      data=self.data, optimizer=self.optimizer, scheduler=self.scheduler,
                                      layout=self.layout)
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        # The saved position dealt out to this run's ranks (the same when the layout is the checkpoint's).
        self.micro_batches_done = self.data.resume_position(state["data"])
        # accelerate finds each step's last micro-batch by counting micro-batches; it restored
        # the saved rank's count, which under another accumulation falls elsewhere in a step.
        acc.step = self.step * self.layout.accumulation
        if acc.is_main_process:
            resume_policy.reset_step_logs(self.output_dir, self.step)
        acc.print(f"resumed from {self.resume.checkpoint}: step {self.step}, epoch {self.epoch}, "
                  f"micro-batch {self.micro_batches_done} of the epoch")

    def _start_logger(self) -> None:
        """The run logger, from the step the run starts at, and the run's one-line summary."""
        cfg, acc = self.cfg, self.accelerator
        self.logger = RunLogger(cfg.logging, output_dir=str(self.output_dir), resolved_config=self.resolved_config,
                                is_main=acc.is_main_process, total_steps=self.total_steps, initial_step=self.step,
                                run_name=cfg.logging.run_name or cfg.run_name, secret_names=self.secret_names)
        per_epoch = (f"{'/'.join(map(str, self.steps_per_epoch))} per epoch" if self.steps_per_epoch
                     else "the epochs planned window by window")
        acc.print(
            f"model: {self.num_params / 1e6:.2f}M parameters, {self.num_trainable / 1e6:.2f}M trainable; "
            f"{self.total_steps} optimizer steps ({per_epoch}) "
            f"on {acc.num_processes} process(es); "
            f"window {self.max_length} tokens"
            + (f" ({self.context_extension.rope_type} RoPE x{self.context_extension.factor:g})"
               if self.context_extension else "")
        )

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
        report_skipped(self.accelerator, self.data, self.output_dir)

    def _training_attention(self) -> contextlib.AbstractContextManager:
        """The training steps' attention (per sample over packed rows when chosen); evaluation
        and generation outside them keep ``model.attn_implementation``."""
        from mmtune.training.packed_attention import use_attention

        if not self.attention.per_sample or self.sequence_parallel is not None:  # SP sets its own per step
            return contextlib.nullcontext()
        return use_attention(self._language_model, self.attention.training_implementation)

    def _train_steps(self) -> None:
        acc, t, cfg, engine = self.accelerator, self.cfg.training, self.cfg, self.engine
        accum = self.layout.accumulation
        sp_size = self.layout.sequence_parallel  # ranks holding each micro-batch: its tokens and images count once
        batches = self._micro_batches()
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        while self.step < self.total_steps:
            started = time.perf_counter()
            micro = [next(batches) for _ in range(accum)]
            # Global loss-token count of this step, before any backward (see module docstring).
            global_tokens = self.objective.begin_step([b for b, _ in micro])
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
                log_sample_ids(self.accelerator, self.output_dir, [meta["ids"] for _, meta in micro], step=self.step,
                               epoch=self.epoch)
            self.nonfinite.check_step(acc, self.step, self.objective.step_loss(float(stats[0])), self.grad_norm,
                                      [meta["ids"] for _, meta in micro])
            if self.step % cfg.logging.every_steps == 0 or self.step == self.total_steps:
                self.logger.log(self.step, step_metrics(
                    stats, elapsed=elapsed, loss=self.objective.step_loss(float(stats[0])), loss_tokens=global_tokens,
                    epoch=self.epoch + self.data.epoch_fraction(self.epoch, self.micro_batches_done),
                    lrs=[(g["name"], lr) for g, lr in zip(self.optim_groups, self.scheduler.get_last_lr())],
                    grad_norm=self.grad_norm, mfu=mfu(self.num_params, float(stats[1]) / elapsed, device_name,
                                                      acc.num_processes)))
            self.logger.advance()
            if t.save_every_steps and self.step % t.save_every_steps == 0 and self.step < self.total_steps:
                self.save_checkpoint()

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
            "config": self.config_record(), "config_changes": self.resume.history,
        })

    def save(self) -> Optional[Path]:
        """Write ``final/`` (HF checkpoint + processor + mmtune_run.json); evaluate it if asked."""
        if not self.cfg.training.save_final:
            return None
        if self.nonfinite.save_problem():
            raise NonFiniteTrainingError(f"final/ {self.nonfinite.save_problem()}; rerun from the last checkpoint "
                                         "with training.resume=auto")
        extras = [self.adapter] if hasattr(self.adapter, "save_pretrained") else [self.adapter.tokenizer]
        self.final_dir = save_final(self.accelerator, self.model, self.output_dir / "final",
                                    save_pretrained_extras=extras, metadata=final_metadata(self),
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
        """Run the ``eval`` benchmarks on the current model and log them (:mod:`mmtune.training.evaluation`)."""
        from mmtune.training.evaluation import evaluate_and_log

        return evaluate_and_log(self, tag=tag, checkpoint=checkpoint)

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


def final_metadata(recipe: SFTRecipe) -> dict[str, Any]:
    """What ``final/mmtune_run.json`` records of the run: family, name, step, window and config."""
    from mmtune.io.secrets import redact

    metadata = {
        "family": recipe.cfg.model.family,
        "run": redact(recipe.run_name, names=recipe.secret_names),
        "step": recipe.step,
        "context_extension": asdict(recipe.context_extension) if recipe.context_extension else None,
        "max_length": recipe.max_length,
        "config": recipe.logger_config(),
    }
    if recipe.resume.history:  # the values above hold from these steps on; the old ones before
        metadata["config_changes"] = recipe.resume.history
    return metadata


def _to_dict(cfg: SFTConfig) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def count_steps(data: Any, training: Any) -> tuple[list[int], int]:
    """``(steps of each epoch planned, optimizer steps of the run)``: the sum over every epoch's own
    plan, capped by ``training.max_steps``.

    Raises:
        ValueError: when the batch plan is empty.
    """
    per_epoch: list[int] = []
    if getattr(data, "windowed", False):  # the epochs' lengths come with their last windows
        return per_epoch, training.max_steps
    for epoch in range(training.epochs):
        if training.max_steps is not None and sum(per_epoch) >= training.max_steps:
            break  # later epochs are never reached; no need to plan them
        per_epoch.append(data.steps_in_epoch(epoch))
    total = sum(per_epoch)
    if total == 0:
        raise ValueError("the batch plan is empty: no sample of data.mixture fits collator.max_length "
                         "(see the truncation stats) or the sources have no records")
    return per_epoch, (min(total, training.max_steps) if training.max_steps is not None else total)


def data_identities(accelerator: Any, sources: Any) -> list[str]:
    """Each data source's content identity (:mod:`mmtune.data.identity`): read once, by the main
    process, and given to every rank."""
    from accelerate.utils import broadcast_object_list

    from mmtune.data.identity import source_identities

    identities = source_identities(sources) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        identities = broadcast_object_list([identities])[0]
    return identities


def report_skipped(accelerator: Any, data: Any, output_dir: Path) -> None:
    """Samples dropped while loading (images that failed to decode, skip mode): printed and in data_report.json."""
    from accelerate.utils import gather_object

    items = data.skipped_items
    if accelerator.num_processes > 1:
        items = gather_object(items)
    if not accelerator.is_main_process:
        return
    windowed = getattr(data, "windowed", False)
    if windowed:  # the report over every record measured by now
        data.refresh_report()
    if items:
        data.merge_skipped(items)
    if windowed or items:
        data.loss_report.write(str(output_dir / "data_report.json"))
    if items:
        accelerator.print(data.loss_report.render_skipped())


def log_sample_ids(accelerator: Any, output_dir: Path, ids_per_micro_batch: list[list[str]], *, step: int,
                   epoch: int) -> None:
    """Append one step's sample ids of every rank to ``sample_ids.jsonl`` (``training.log_sample_ids``)."""
    from accelerate.utils import gather_object

    gathered = gather_object([{"rank": accelerator.process_index, "ids": ids_per_micro_batch}])
    if accelerator.is_main_process:
        path = output_dir / "sample_ids.jsonl"
        with disk_full_guard(path, "sample_ids.jsonl", intact=lambda: intact_note(output_dir)):
            with open_output(path, "a") as f:
                f.write(json.dumps({"step": step, "epoch": epoch,
                                    "ranks": sorted(gathered, key=lambda r: r["rank"])}) + "\n")

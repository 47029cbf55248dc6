"""Resume policy: find the checkpoint to continue, verify it, refuse what cannot continue exactly, record changes.

The recipe asks this module four things, in its lifecycle's order:

1. :func:`refuse_used_output_dir`: a folder an earlier run used is not trained into afresh
   (unless ``training.overwrite_output_dir``).
2. :func:`choose_checkpoint`: the checkpoint ``training.resume`` names (``auto``: the newest
   intact one), verified against its manifest's content hashes. This is the one place a checkpoint is chosen.
3. :func:`check_resume`: the rank layout (:func:`check_resume_layout`) and the config
   (:func:`~mmtune.training.checkpoint.check_resume_config`) against the checkpoint's; what
   changed and was allowed is recorded (:class:`Resume`).
4. :func:`restore`: the checkpoint loaded into the wrapped run, the allowed changes applied,
   the per-step logs cut back to its step.

Every refusal is a :class:`~mmtune.training.checkpoint.ResumeConfigError` (or
``FileNotFoundError`` / ``OutputDirInUseError`` / ``IncompleteCheckpointError``) naming the checkpoint, the keys and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from mmtune.training.checkpoint import TRAINER_STATE, ResumeConfigError, complete_checkpoints, read_trainer_state
from mmtune.training.layout import RankLayout
from mmtune.training.manifest import choose_resume_checkpoint_once

__all__ = ["Resume", "lock_output_dir", "claim_output_dir", "refuse_used_output_dir", "choose_checkpoint",
           "check_resume_layout", "check_resume", "plan_resume", "restore", "reset_step_logs", "apply_allowed_changes", "random_state_note"]

Say = Callable[[str], None]


@dataclass
class Resume:
    """What a run resumes from and the config changes recorded with it."""

    checkpoint: Optional[Path] = None
    """The checkpoint to continue (``None``: a fresh run)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Allowed config changes on every resume so far, this one's included: ``{"effective_from_step",
    "resumed_from", "changes": {key: {"old", "new"}}}`` (what checkpoints and ``final/`` record)."""
    changes: dict[str, Any] = field(default_factory=dict)
    """This resume's allowed changes (``{key: {"old", "new"}}``)."""


def lock_output_dir(accelerator: Any, output_dir: Path) -> Any:
    """Refuse a second job writing into this run's folder (every rank stops with the holder's details).

    Only the main process takes the lock: every rank of this job writes into the folder
    (its RNG state, its engine's shards), which is legitimate. Another job's main process
    then finds it held; the refusal is broadcast so that its other ranks stop at once
    with the same message instead of waiting at the next barrier.

    Returns:
        The lock (the main process's; ``None`` on the others).
    """
    from accelerate.utils import broadcast_object_list

    from mmtune.io.locks import DirectoryLockedError, lock_directory

    lock, refusal = None, None
    if accelerator.is_main_process:
        try:
            lock = lock_directory(
                output_dir, purpose="training",
                hint="set training.output_dir to another folder (to continue that run once it has stopped, "
                     "rerun with training.resume=auto)")
        except DirectoryLockedError as err:
            refusal = str(err)
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise DirectoryLockedError(refusal)
    return lock


def claim_output_dir(accelerator: Any, output_dir: Path, requested: Optional[str], *, overwrite: bool = False) -> Any:
    """Lock ``output_dir`` (:func:`lock_output_dir`), finish saves an earlier attempt left half-renamed, and
    refuse a used folder unless resuming or overwriting (:func:`refuse_used_output_dir`). Returns the lock."""
    from mmtune.training.checkpoint import recover_interrupted_saves

    lock = lock_output_dir(accelerator, output_dir)
    if accelerator.is_main_process:
        recover_interrupted_saves(output_dir)  # a save killed between its renames
    accelerator.wait_for_everyone()
    refuse_used_output_dir(accelerator, output_dir, requested, overwrite=overwrite)
    return lock


def refuse_used_output_dir(accelerator: Any, output_dir: Path, requested: Optional[str], *, overwrite: bool) -> None:
    """Refuse a fresh run into a folder an earlier run used (checkpoints, ``final/``, per-step logs),
    or with ``training.overwrite_output_dir`` clear it (the main process; every rank waits).

    Raises:
        OutputDirInUseError: naming what the folder holds and the three ways on.
    """
    from mmtune.training.checkpoint import check_output_dir, earlier_run

    earlier = earlier_run(output_dir) if requested is None else []  # every rank: each raises alike
    if earlier and accelerator.is_main_process:
        accelerator.print(check_output_dir(output_dir, resume=requested, overwrite=overwrite))
    elif earlier and not overwrite:
        check_output_dir(output_dir, resume=requested, overwrite=False)
    accelerator.wait_for_everyone()


def choose_checkpoint(requested: Optional[str], output_dir: Path, accelerator: Any) -> Optional[Path]:
    """The checkpoint ``training.resume`` asks for (``None``, ``auto`` or a folder), verified; ``None`` for none.

    The newest checkpoint whose files are all there and intact, by their recorded content hashes
    (:mod:`mmtune.training.manifest`), verified once by the main process and its answer given to
    every rank; a note saying which newer ones were passed over, and why, is printed.

    Raises:
        IncompleteCheckpointError: the named checkpoint, or with ``auto`` every one, is incomplete.
    """
    chosen, passed_over = choose_resume_checkpoint_once(
        accelerator, requested, lambda: complete_checkpoints(output_dir), lambda c: read_trainer_state(c).get("step"))
    if passed_over:
        accelerator.print(passed_over)
    return chosen


def check_resume_layout(checkpoint: Any, state: dict[str, Any], engine: Any, layout: RankLayout) -> str:
    """Refuse a resume whose rank layout cannot continue the checkpoint's exactly, before anything loads.

    A checkpoint continues on another number of processes when the engine can load its
    state there (:meth:`~mmtune.training.engines.base.Engine.reshard_problem`) and the
    data position keeps its global batch, ranks x gradient accumulation
    (:func:`~mmtune.data.datamodule.layout_problem`).

    Args:
        state: the checkpoint's ``trainer_state.json``.
        layout: this run's rank layout.

    Returns:
        A line saying how the layout changed (empty when it did not).

    Raises:
        ResumeConfigError: one message with every problem and its fix.
    """
    from mmtune.data.datamodule import layout_problem

    data = state.get("data")
    if data is None:  # nothing recorded to compare with
        return ""
    per_rank, ranks, accumulation = layout.sequence_parallel, layout.data_ranks, layout.accumulation
    saved_ranks = int(data.get("world_size", ranks))
    saved_processes = int(state.get("num_processes", saved_ranks * per_rank))
    problems = [problem for problem in (
        engine.reshard_problem(saved_processes, layout.num_processes),
        layout_problem(data, ranks, accumulation, processes_per_rank=per_rank)) if problem]
    if problems:
        raise ResumeConfigError(f"cannot resume from {checkpoint} (step {state.get('step')}) on "
                                f"{layout.num_processes} process(es): " + "; ".join(problems))
    saved_accumulation = data.get("accumulation", accumulation)
    if (saved_ranks, saved_accumulation) == (ranks, accumulation):
        return ""
    return (f"resuming on {ranks} rank(s) x {accumulation} micro-batch(es) per step, saved on {saved_ranks} x "
            f"{saved_accumulation}: the same {ranks * accumulation} micro-batches per optimizer step, so every step "
            "trains the samples of the uninterrupted run")


def check_resume(checkpoint: Path, *, engine: Any, layout: RankLayout, current: dict[str, Any],
                 allowed: list[str], say: Say) -> Resume:
    """Check a resume from ``checkpoint`` and record its allowed config changes; refuse one not allowed.

    First the rank layout (:func:`check_resume_layout`), then this run's config record
    ``current`` against the one the checkpoint was saved with
    (:func:`~mmtune.training.checkpoint.check_resume_config`, changes allowed by ``allowed``:
    ``training.resume_config_changes``).

    Raises:
        FileNotFoundError: ``checkpoint`` is not a complete mmtune checkpoint.
        ResumeConfigError: the layout or the config cannot continue it.
    """
    from mmtune.data.datamodule import saved_global_batch
    from mmtune.data.identity import comparable_record
    from mmtune.training.checkpoint import check_resume_config

    if not (Path(checkpoint) / TRAINER_STATE).is_file():
        raise FileNotFoundError(
            f"training.resume: {checkpoint} has no {TRAINER_STATE}, so it is not a complete mmtune "
            "checkpoint; name a <output_dir>/checkpoints/step-N folder, or use training.resume=auto")
    state = read_trainer_state(checkpoint)
    layout_change = check_resume_layout(checkpoint, state, engine, layout)
    if layout_change:
        say(layout_change)
    # The layout check compared ranks x accumulation, so the accumulation alone may differ.
    free = ({"training.gradient_accumulation_steps": "the same global batch on another number of ranks"}
            if saved_global_batch(state.get("data", {})) is not None else {})
    history = list(state.get("config_changes", []))
    if "config" not in state:
        say(f"note: {checkpoint} does not record its run's config (saved by an older mmtune), so changes to it "
            "cannot be checked")
        return Resume(Path(checkpoint), history)
    current, unchecked = comparable_record(state["config"], current)
    if unchecked:
        say(f"{checkpoint}: {unchecked}")
    changes = check_resume_config(checkpoint, state, current, allowed, free=free)
    if changes:
        step = int(state["step"])
        history.append({"effective_from_step": step + 1, "resumed_from": str(checkpoint), "changes": changes})
        say("resuming with config changes allowed by training.resume_config_changes, from step "
            f"{step + 1}: " + "; ".join(f"{key}: {c['old']!r} -> {c['new']!r}" for key, c in changes.items()))
    return Resume(Path(checkpoint), history, changes)


def plan_resume(training: Any, output_dir: Path, *, engine: Any, layout: RankLayout,
                config_record: Callable[[], dict[str, Any]], accelerator: Any) -> Resume:
    """Find and check the resume ``training`` asks for (``training.resume``), before anything is built.

    Returns:
        :class:`Resume` (its ``checkpoint`` is ``None`` for a fresh run).
    """
    checkpoint = choose_checkpoint(training.resume, output_dir, accelerator)
    if checkpoint is None:
        return Resume()
    return check_resume(checkpoint, engine=engine, layout=layout, current=config_record(),
                        allowed=list(training.resume_config_changes), say=accelerator.print)


def reset_step_logs(output_dir: Path, step: Optional[int]) -> None:
    """The per-step logs (``metrics.jsonl``, ``sample_ids.jsonl``) for a run starting after ``step``.

    A fresh run (``step=None``) removes those of an earlier attempt in the folder, which would
    mix in; a resume drops the rows after its checkpoint's step, logged by the interrupted
    attempt and about to be trained again, so each step appears once.
    """
    from mmtune.training.logging import cut_jsonl_after

    for name in ("metrics.jsonl", "sample_ids.jsonl"):
        if step is None:
            (output_dir / name).unlink(missing_ok=True)
        else:
            cut_jsonl_after(output_dir / name, step)


def apply_allowed_changes(optimizer: Any, scheduler: Any, fresh_groups: list[dict[str, Any]],
                          fresh_base_lrs: list[float]) -> None:
    """Make allowed changes of the optimizer and schedule take effect after a checkpoint load.

    Loading restores the optimizer's param-group settings (lr, weight decay, betas,
    epsilon) and the scheduler's base learning rates from the checkpoint, so without
    this a changed ``training.lr`` would be recorded but never used. The moments and
    the step count stay the checkpoint's; the schedule's shape (type, warm-up, length)
    is already this run's, since the scheduler was built from this config.

    Args:
        scheduler: the wrapped scheduler (accelerate's); its ``scheduler`` is transformers' LambdaLR.
    """
    inner = scheduler.scheduler
    inner.base_lrs = list(fresh_base_lrs)
    for group, fresh, base, factor in zip(optimizer.param_groups, fresh_groups, inner.base_lrs, inner.lr_lambdas):
        for key in ("weight_decay", "betas", "eps", "initial_lr"):
            if key in fresh:
                group[key] = fresh[key]
        group["lr"] = base * factor(inner.last_epoch)


def random_state_note(state: dict[str, Any], layout: RankLayout) -> str:
    """Which processes did not get their own random state back from a checkpoint saved on another number.

    accelerate's ``load_state`` restores ``random_states_<i>.pkl`` on process ``i`` and, for
    a process without that file, logs and goes on: its Python, NumPy and torch generators
    keep the state they reached at start-up, seeded with ``training.seed`` like every
    process of a fresh run. Files of processes this run does not have are not read.
    Empty when the numbers agree.
    """
    ranks = state.get("data", {}).get("world_size", layout.data_ranks)
    saved, now = int(state.get("num_processes", ranks * layout.sequence_parallel)), layout.num_processes
    if saved == now:
        return ""
    if now > saved:
        return (f"random state: the checkpoint holds those of {saved} process(es); processes {saved}..{now - 1} "
                "have none and continue from their start-up state (training.seed)")
    return (f"random state: processes 0..{now - 1} restored their own; those of processes {now}..{saved - 1} "
            "are not used")


def restore(resume: Resume, *, accelerator: Any, checkpoints: Any, engine: Any, data: Any, optimizer: Any,
            scheduler: Any, layout: RankLayout) -> dict[str, Any]:
    """Load ``resume.checkpoint`` into the wrapped run; returns its trainer state.

    The data plan is checked first (before anything loads); the allowed changes
    (:func:`apply_allowed_changes`) take effect after the load.

    Raises:
        ResumeConfigError: when the checkpoint's data plan does not match this run's data.
    """
    saved = read_trainer_state(resume.checkpoint)
    try:  # before anything loads
        data.check_state(saved["data"], processes_per_rank=layout.sequence_parallel)
    except ValueError as err:  # a resume refusal like a changed config: one message, no traceback
        raise ResumeConfigError(f"cannot resume from {resume.checkpoint} (step {saved['step']}): {err}") from None
    # This run's optimizer settings, before the checkpoint's replace them.
    fresh = ([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
             list(scheduler.scheduler.base_lrs))
    state = checkpoints.load(accelerator, resume.checkpoint, engine=engine)
    if resume.changes:
        apply_allowed_changes(optimizer, scheduler, *fresh)
    note = random_state_note(state, layout)
    if note:
        accelerator.print(note)
    return state

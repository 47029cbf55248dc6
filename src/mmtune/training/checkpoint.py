"""Resumable checkpoints (atomic, keep-last-N) and the final HF checkpoint.

Layout under ``<output_dir>``::

    checkpoints/step-<N>/         resumable: the engine's state (model, optimizer,
                                  scheduler, per-rank RNG; sharded where the engine
                                  shards) + trainer_state.json (step, epoch, data position)
    final/                        a normal HF checkpoint (``from_pretrained``-able,
                                  loadable with ``ModelConfig(path=...)``) + mmtune_run.json
    final/adapter/                LoRA runs: the peft adapter + non-LoRA trained weights

Safe saves: write aside, swap by rename, delete last. Every save (a resumable
checkpoint or ``final/``) is written to ``.tmp-<name>``, whose marker file
(``trainer_state.json`` or ``mmtune_run.json``) is written last. Only then does an
existing ``<name>`` move aside to ``.old-<name>``, the new copy take its place (both
``os.replace``, atomic on POSIX file systems), and the old copy get deleted; pruning of
older checkpoints comes after that. A process killed at any point therefore leaves a
complete copy: ``<name>`` itself, or, between the two renames, ``.old-<name>`` next to
a complete ``.tmp-<name>``. :func:`latest_checkpoint` finds it either way and
:func:`recover_interrupted_saves` (run at start-up and before each save) puts it back
in place. Multi-node runs need ``output_dir`` on a shared file system (every rank
writes its RNG state).

A full disk therefore fails inside ``.tmp-<name>``: that partial copy is deleted (giving
its space back) and a :class:`~mmtune.io.disk.DiskFullError` names the path, the space
left and the last complete checkpoint, which nothing touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from mmtune.io.disk import disk_full_guard
from mmtune.io.nofollow import open_output
from mmtune.io.permissions import restore_default_modes
from mmtune.schema_keys import flatten_config, key_covers
from mmtune.training.manifest import IncompleteCheckpointError, write_manifest

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator
    from torch import nn

    from mmtune.training.engines import Engine

__all__ = ["TRAINER_STATE", "RUN_METADATA", "SAVE_POINTS", "RESUME_FREE_KEYS", "CheckpointManager",
           "OutputDirInUseError", "ResumeConfigError", "check_output_dir", "check_resume_config", "earlier_run", "complete_checkpoints", "config_differences", "flatten_config", "intact_note",
           "json_bytes", "key_covers", "latest_checkpoint", "read_trainer_state", "recover_interrupted_saves", "save_final",
           "write_json_atomic"]

TRAINER_STATE = "trainer_state.json"
RUN_METADATA = "mmtune_run.json"
_STEP_DIR = re.compile(r"^(\.tmp-|\.old-)?step-(\d+)$")
# The points a save passes, in order; ``on_save_point`` callbacks receive these names
# (tests use them to interrupt a save at each point).
SAVE_POINTS = ("written", "old_moved_aside", "new_in_place", "old_deleted", "pruned")
SavePointHook = Optional[Callable[[str], None]]


# Config keys that may differ between a checkpoint's run and the run resuming it, and why:
# none of them changes which samples are trained, in what order, or how a step updates the
# weights. A key covers the keys under it. Every other key is refused when it changed
# (model, data, collator, optimizer and schedule, training length, seed, precision, peft,
# context, synthetic data), unless ``training.resume_config_changes`` names it.
RESUME_FREE_KEYS: dict[str, str] = {
    "training.output_dir": "the same folder, perhaps spelled differently or moved",
    "training.resume": "how the checkpoint is found, not what it continues",
    "training.resume_config_changes": "the permission itself",
    "training.save_every_steps": "when checkpoints are written",
    "training.keep_last": "how many checkpoints are kept",
    "training.max_nonfinite_steps": "when a run whose loss went non-finite stops, not what a finite step computes",
    "training.overwrite_output_dir": "whether a fresh run may replace an earlier one, never read when resuming",
    "training.save_final": "whether final/ is written",
    "training.num_workers": "how many processes load the same batches",
    "training.log_sample_ids": "a log",
    "training.eval_before": "evaluation reads the model and never trains it",
    "training.eval_after": "evaluation reads the model and never trains it",
    "training.compile": "the same computation, compiled",
    "training.gradient_checkpointing": "activations recomputed instead of stored: the same gradients, less memory",
    "training.loss_impl": "the same token-weighted loss computed another way (equal within 1e-5)",
    "training.loss_chunk_size": "rows per chunk of the same loss",
    "training.backend.ddp.find_unused_parameters": "DDP's bookkeeping of parameters without gradient",
    "peft.merge_on_save": "how final/ is written",
    "data.cache_dir": "where the same parsed records are cached",
    "collator.image_cache_dir": "where the same pixels are cached",
    "collator.image_cache_key": "how the pixel cache is keyed",
    "collator.length_cache_dir": "where the same sample lengths are cached",
    "logging": "where metrics go",
    "eval": "benchmarks read the model and never train it",
    "run_name": "a label",
    "recipe": "which script runs the config (always sft for a training run)",
    "launcher": "the launch file planned for, not what a step computes",
}
_ABSENT = object()


class ResumeConfigError(ValueError):
    """Resuming would continue a checkpoint with a config that differs in keys that affect training."""


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (saved value, current value)}`` for every key whose value differs; a key
    missing on one side has :data:`_ABSENT` there."""
    old, new = flatten_config(saved), flatten_config(current)
    return {key: (old.get(key, _ABSENT), new.get(key, _ABSENT)) for key in sorted(old.keys() | new.keys())
            if old.get(key, _ABSENT) != new.get(key, _ABSENT)}


def _shown(value: Any) -> str:
    text = "(not set)" if value is _ABSENT else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_resume_config(checkpoint: str | os.PathLike, state: dict[str, Any], current: dict[str, Any],
                        allowed: list[str], *, free: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """The changes of ``current`` from the config ``state["config"]`` was saved with, where allowed.

    Keys under :data:`RESUME_FREE_KEYS` (and under ``free``: keys this resume has already
    checked otherwise, with why) may differ freely and are not returned; keys the
    user allowed (``training.resume_config_changes``) are returned as ``{key: {"old",
    "new"}}`` to be recorded; any other difference raises.

    Raises:
        ResumeConfigError: listing every refused key as ``key: old -> new`` and how to fix it.
    """
    free_keys = [*RESUME_FREE_KEYS, *(free or {})]
    changed = {key: values for key, values in config_differences(state["config"], current).items()
               if not any(key_covers(free_key, key) for free_key in free_keys)}
    refused = {key: values for key, values in changed.items() if not any(key_covers(a, key) for a in allowed)}
    if refused:
        step = state.get("step")
        lines = "\n  - ".join(f"{key}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in refused.items())
        entries = ",".join(f'"{key}"' if "[" in key else key for key in refused)
        raise ResumeConfigError(
            f"cannot resume from {checkpoint} (step {step}): its run was trained with another config:\n  - {lines}\n"
            f"Resuming as is would continue the run after step {step} with settings it was not trained with, and "
            "record nowhere where they changed (a changed optimizer setting would even be overridden by the "
            "checkpoint's own, while this config claims it). How to fix: "
            "rerun with the checkpoint's values; or start afresh in another training.output_dir; or allow exactly "
            f"these changes with 'training.resume_config_changes=[{entries}]' (recorded with the step they take "
            "effect in the checkpoints' trainer_state.json and final/mmtune_run.json)."
            + (" A new length (training.max_steps, training.epochs) also reshapes the learning-rate schedule from "
               "this step on: it decays over the new number of steps."
               if any(key in refused for key in ("training.max_steps", "training.epochs")) else "")
        )
    return {key: {"old": None if old is _ABSENT else old, "new": None if new is _ABSENT else new}
            for key, (old, new) in changed.items()}


def json_bytes(payload: Any) -> bytes:
    """``payload`` as the JSON bytes :func:`write_json_atomic` writes."""
    return json.dumps(payload, indent=2, sort_keys=True, default=str).encode("utf-8")


def write_json_atomic(path: str | os.PathLike, payload: Any, *, content: Optional[bytes] = None) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace`` (never half-written).

    ``content``: the bytes to write, already serialised with :func:`json_bytes` (what the
    manifest hashed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open_output(tmp, "wb") as f:
        f.write(json_bytes(payload) if content is None else content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _aside(path: Path, kind: str) -> Path:
    return path.with_name(f".{kind}-{path.name}")


def _swap_into_place(tmp: Path, final: Path, on_save_point: SavePointHook = None) -> None:
    """Put the complete ``tmp`` at ``final``: old copy aside, new one in, old one deleted."""
    reached = on_save_point or (lambda point: None)
    reached("written")
    old = _aside(final, "old")
    if final.exists():
        if old.exists():  # left by an earlier interrupted save; ``final`` is complete
            shutil.rmtree(old)
        os.replace(final, old)
        reached("old_moved_aside")
    os.replace(tmp, final)
    reached("new_in_place")
    if old.exists():
        shutil.rmtree(old)
    reached("old_deleted")


def _recover(final: Path, marker: str) -> None:
    tmp, old = _aside(final, "tmp"), _aside(final, "old")
    if not final.exists():
        if (tmp / marker).is_file():  # interrupted between the two renames: the new copy is complete
            os.replace(tmp, final)
        elif (old / marker).is_file():
            os.replace(old, final)
    if (final / marker).is_file() and old.exists():
        shutil.rmtree(old)


def recover_interrupted_saves(output_dir: str | os.PathLike) -> None:
    """Finish saves that a killed process left between their two renames (main process only).

    Puts a complete ``.tmp-<name>`` (else ``.old-<name>``) back at ``<name>`` for every
    checkpoint and ``final/`` whose own directory is missing, and drops leftover
    ``.old-*`` copies. Incomplete ``.tmp-*`` directories stay for the next save to clear.
    """
    output_dir = Path(output_dir)
    _recover(output_dir / "final", RUN_METADATA)
    checkpoints = output_dir / "checkpoints"
    if checkpoints.is_dir():
        steps = {int(m.group(2)) for m in map(_STEP_DIR.match, os.listdir(checkpoints)) if m}
        for step in sorted(steps):
            _recover(checkpoints / f"step-{step}", TRAINER_STATE)


def _complete_checkpoints(checkpoints_dir: Path, *, aside: bool = False) -> list[tuple[int, Path]]:
    """Complete ``step-<N>`` directories; with ``aside``, also a complete ``.tmp-``/``.old-``
    copy of a step whose own directory a killed save left missing."""
    if not checkpoints_dir.is_dir():
        return []
    found: dict[int, Path] = {}
    left_aside: dict[int, list[tuple[str, Path]]] = {}
    for child in checkpoints_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        # The marker file is written last inside the temporary directory, so a directory
        # without it is an interrupted write.
        if not match or not (child / TRAINER_STATE).is_file():
            continue
        step = int(match.group(2))
        if match.group(1) is None:
            found[step] = child
        elif aside:
            left_aside.setdefault(step, []).append((match.group(1), child))
    for step, copies in left_aside.items():
        if step not in found and not (checkpoints_dir / f"step-{step}").exists():
            found[step] = max(copies, key=lambda c: c[0] == ".tmp-")[1]  # the new copy if complete
    return sorted(found.items())


def complete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Every complete checkpoint of a run, oldest first (as :func:`latest_checkpoint` finds them)."""
    return [path for _, path in _complete_checkpoints(Path(output_dir) / "checkpoints", aside=True)]


def latest_checkpoint(output_dir: str | os.PathLike) -> Optional[Path]:
    """The complete checkpoint with the highest step, or ``None``.

    Normally ``checkpoints/step-<N>``; if a save was killed between its two renames, the
    complete copy it left aside (see the module docstring).
    """
    found = _complete_checkpoints(Path(output_dir) / "checkpoints", aside=True)
    return found[-1][1] if found else None


def read_trainer_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    with open(Path(checkpoint) / TRAINER_STATE) as f:
        return json.load(f)


class CheckpointManager:
    """Writes and prunes resumable checkpoints for one run directory."""

    def __init__(self, output_dir: str | os.PathLike, keep_last: int = 2, *, on_save_point: SavePointHook = None):
        self.output_dir = Path(output_dir)
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.keep_last = keep_last
        self.on_save_point = on_save_point

    def save(self, accelerator: "Accelerator", step: int, trainer_state: dict[str, Any], *,
             engine: Optional["Engine"] = None) -> Path:
        """Save a resumable checkpoint for optimizer step ``step`` (call on every rank).

        ``engine`` writes the model, optimizer, scheduler and RNG state (sharded where it
        shards); without one, ``accelerator.save_state`` does.

        Returns:
            The final ``step-<N>`` directory.

        Raises:
            DiskFullError: no space was left while writing it; the partial copy is deleted
                and the message names the last complete checkpoint, which is untouched.
        """
        final = self.checkpoints_dir / f"step-{step}"
        tmp = self.checkpoints_dir / f".tmp-step-{step}"
        if accelerator.is_main_process:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            recover_interrupted_saves(self.output_dir)
            for stale in self.checkpoints_dir.glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-write
        accelerator.wait_for_everyone()
        # A full disk fails the write into .tmp-step-N, before anything complete is touched.
        guard = disk_full_guard(tmp, f"checkpoint step {step}", intact=lambda: intact_note(self.output_dir),
                                cleanup=(lambda: shutil.rmtree(tmp, ignore_errors=True))
                                if accelerator.is_main_process else None)
        with guard:
            # Model, optimizer, scheduler, grad scaler and every rank's RNG states, as the
            # engine keeps them (sharded engines write every rank's shards).
            if engine is not None:
                engine.save_state(tmp)
            else:
                accelerator.save_state(str(tmp), safe_serialization=True)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                restore_default_modes(tmp)  # safetensors writes 0600 whatever the umask (io/permissions.py)
                # What a resume verifies (training/manifest.py): every file's size and content hash,
                # the marker's from the bytes written after it.
                marker = json_bytes({**trainer_state, "step": step})
                write_manifest(tmp, written_after=[TRAINER_STATE], later_contents={TRAINER_STATE: marker})
                write_json_atomic(tmp / TRAINER_STATE, None, content=marker)
        if accelerator.is_main_process:
            _swap_into_place(tmp, final, self.on_save_point)
            self._prune()
            if self.on_save_point is not None:
                self.on_save_point("pruned")
        accelerator.wait_for_everyone()
        return final

    def _prune(self) -> None:
        complete = _complete_checkpoints(self.checkpoints_dir)
        for _, path in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, accelerator: "Accelerator", checkpoint: str | os.PathLike, *,
             engine: Optional["Engine"] = None) -> dict[str, Any]:
        """Restore model/optimizer/scheduler/RNG from ``checkpoint`` (through ``engine`` when
        given); return its trainer state.

        Raises:
            IncompleteCheckpointError: a file failed to load (a checkpoint the manifest could
                not verify: saved before content hashes, or damaged after the check); the
                message names the checkpoint, the error, and the newest other one to resume from.
        """
        try:
            if engine is not None:
                engine.load_state(Path(checkpoint))
            else:
                accelerator.load_state(str(checkpoint))
            return read_trainer_state(checkpoint)
        except Exception as err:  # noqa: BLE001 - torch, safetensors, pickle and accelerate each raise their own
            others = [c for c in complete_checkpoints(self.output_dir)
                      if os.path.realpath(c) != os.path.realpath(checkpoint)]
            way_out = (f"resume from an older one with training.resume={others[-1]}" if others else
                       "start afresh in another training.output_dir")
            raise IncompleteCheckpointError(
                f"cannot resume: {checkpoint} failed to load ({type(err).__name__}: {str(err)[:300]}); its files "
                f"are damaged in a way its manifest could not show: {way_out}") from err


class OutputDirInUseError(FileExistsError):
    """A fresh run (no ``training.resume``) was pointed at a folder an earlier run wrote into."""


def earlier_run(output_dir: str | os.PathLike) -> list[str]:
    """What an earlier run left in ``output_dir`` that a fresh run would overwrite (empty: nothing).

    Checkpoints (complete or not), ``final/`` and the per-step logs count; data files,
    caches and reports a run only reads or rewrites whole do not.
    """
    output_dir = Path(output_dir)
    found = []
    checkpoints = output_dir / "checkpoints"
    if checkpoints.is_dir() and any(_STEP_DIR.match(c.name) for c in checkpoints.iterdir()):
        found.append(f"checkpoints (latest: {latest_checkpoint(output_dir) or 'none complete'})")
    if (output_dir / "final").exists():
        found.append("final/")
    found += [name for name in ("metrics.jsonl", "sample_ids.jsonl") if (output_dir / name).is_file()]
    return found


def check_output_dir(output_dir: str | os.PathLike, *, resume: Optional[str], overwrite: bool) -> Optional[str]:
    """Refuse a fresh run into a used folder; with ``overwrite``, clear what would mix in (main process).

    Returns:
        A line saying what was deleted, with ``overwrite`` on a used folder (else ``None``).

    Raises:
        OutputDirInUseError: naming what the folder holds and the three ways on.
    """
    found = earlier_run(output_dir) if resume is None else []
    if not found:
        return None
    if not overwrite:
        raise OutputDirInUseError(
            f"{output_dir} holds an earlier run ({', '.join(found)}), which a fresh run would overwrite. "
            "Choose one: training.resume=auto to continue it; another training.output_dir to keep it; or "
            "training.overwrite_output_dir=true to replace it")
    shutil.rmtree(Path(output_dir) / "checkpoints", ignore_errors=True)
    for log in ("metrics.jsonl", "sample_ids.jsonl"):
        (Path(output_dir) / log).unlink(missing_ok=True)
    return (f"training.overwrite_output_dir=true: deleted the earlier run's checkpoints and per-step logs in "
            f"{output_dir}; final/ is replaced when this run saves")


def intact_note(output_dir: str | os.PathLike) -> str:
    """What a failed write left intact in a run directory, for error messages (main process).

    A save writes aside and swaps last (module docstring), so whatever failed, the latest
    complete checkpoint is the one :func:`latest_checkpoint` finds.
    """
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return "No resumable checkpoint had been saved yet in this run."
    step = read_trainer_state(latest).get("step")
    return (f"The last complete checkpoint, {latest} (step {step}), is intact: rerun with training.resume=auto "
            "to continue from it.")


def save_final(accelerator: "Accelerator", model: "nn.Module", out_dir: str | os.PathLike, *,
               save_pretrained_extras: list[Any], metadata: dict[str, Any], merge_lora: bool = True,
               on_save_point: SavePointHook = None, engine: Optional["Engine"] = None) -> Path:
    """Write ``out_dir`` as a normal HF checkpoint (call on every rank).

    The engine (``accelerator.get_state_dict`` without one) gathers sharded weights into
    full tensors on the main process, so the result is ``from_pretrained``-able, not an
    engine's shard folder.
    A re-save never deletes the old copy before the new one is complete (see the module
    docstring). For a peft model, ``out_dir/adapter`` holds the adapter plus
    ``non_lora_trainables.safetensors`` (every trained non-LoRA weight, e.g. the
    projector), and ``out_dir`` the merged model when ``merge_lora``.

    Args:
        save_pretrained_extras: objects with ``save_pretrained`` (tokenizer, processor)
            written next to the weights.
        metadata: written to ``mmtune_run.json``.

    Raises:
        DiskFullError: no space was left; the partial copy is deleted and the message
            says what is intact (the previous ``final/`` and the last checkpoint).
    """
    out_dir = Path(out_dir)
    tmp = _aside(out_dir, "tmp")
    if accelerator.is_main_process:
        _recover(out_dir, RUN_METADATA)
        if tmp.exists():
            shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    # A collective under sharding engines: every rank takes part.
    state_dict = engine.full_state_dict(model) if engine is not None else accelerator.get_state_dict(model)
    merge_problem = engine.merge_problem() if engine is not None else ""
    if accelerator.is_main_process:
        # The module whose save_pretrained (and merge) writes the weights: the trained model
        # itself, or an unsharded copy holding the gathered ones (Engine.final_model).
        unwrapped = engine.final_model(model, state_dict) if engine is not None else accelerator.unwrap_model(model)
        previous = " The previous final/ is intact." if (out_dir / RUN_METADATA).is_file() else ""
        with disk_full_guard(tmp, "the final checkpoint", cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True),
                             intact=lambda: f"{out_dir} was not replaced.{previous} " + intact_note(out_dir.parent)):
            _write_final(tmp, unwrapped, state_dict, merge_problem, save_pretrained_extras, metadata, merge_lora)
        _swap_into_place(tmp, out_dir, on_save_point)
    accelerator.wait_for_everyone()
    return out_dir


def _write_final(tmp: Path, unwrapped: "nn.Module", state_dict: dict[str, Any], merge_problem: str,
                 save_pretrained_extras: list[Any], metadata: dict[str, Any], merge_lora: bool) -> None:
    """The complete ``final/`` copy in ``tmp``, its marker file last (main process)."""
    from mmtune.training.peft_setup import is_peft_model, merged_model

    tmp.mkdir(parents=True)
    if is_peft_model(unwrapped):
        trained = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
        unwrapped.save_pretrained(tmp / "adapter", state_dict=state_dict, safe_serialization=True)
        extra = {k: v for k, v in state_dict.items() if k in trained and "lora_" not in k}
        if extra:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp / "adapter" / "non_lora_trainables.safetensors"))
        if merge_lora and not merge_problem:
            merged_model(unwrapped).save_pretrained(tmp, safe_serialization=True)
        elif merge_lora:
            metadata = {**metadata, "merged": False, "merged_note": merge_problem}
    else:
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    for extra_obj in save_pretrained_extras:
        extra_obj.save_pretrained(tmp)
    restore_default_modes(tmp)  # safetensors writes 0600 whatever the umask (io/permissions.py)
    write_json_atomic(tmp / RUN_METADATA, metadata)  # last: marks the copy complete

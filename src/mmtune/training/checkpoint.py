"""Resumable checkpoints (atomic, keep-last-N) and the final HF checkpoint.

Layout under ``<output_dir>``::

    checkpoints/step-<N>/         resumable: accelerate state (model, optimizer,
                                  scheduler, per-rank RNG) + trainer_state.json
                                  (step, epoch, data position)
    final/                        a normal HF checkpoint (``from_pretrained``-able,
                                  loadable with ``ModelConfig(path=...)``) + mmtune_run.json
    final/adapter/                LoRA runs: the peft adapter + non-LoRA trained weights

Atomicity: everything is written to ``checkpoints/.tmp-step-<N>`` and only then renamed
to ``step-<N>`` (``os.replace`` of a directory is atomic on POSIX file systems). A crash
mid-write leaves a ``.tmp-*`` directory that :func:`latest_checkpoint` ignores and the
next save removes, so the previous checkpoint stays the one resumed from. Multi-node
runs need ``output_dir`` on a shared file system (every rank writes its RNG state).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from accelerate import Accelerator
    from torch import nn

__all__ = ["TRAINER_STATE", "RUN_METADATA", "CheckpointManager", "latest_checkpoint", "read_trainer_state",
           "save_final", "write_json_atomic"]

TRAINER_STATE = "trainer_state.json"
RUN_METADATA = "mmtune_run.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def write_json_atomic(path: str | os.PathLike, payload: Any) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace`` (never half-written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _complete_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        # trainer_state.json is written last inside the temporary directory, so a
        # renamed directory without it cannot exist; the check guards against copies.
        if match and (child / TRAINER_STATE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike) -> Optional[Path]:
    """The complete ``checkpoints/step-<N>`` with the highest N, or ``None``."""
    found = _complete_checkpoints(Path(output_dir) / "checkpoints")
    return found[-1][1] if found else None


def read_trainer_state(checkpoint: str | os.PathLike) -> dict[str, Any]:
    with open(Path(checkpoint) / TRAINER_STATE) as f:
        return json.load(f)


class CheckpointManager:
    """Writes and prunes resumable checkpoints for one run directory."""

    def __init__(self, output_dir: str | os.PathLike, keep_last: int = 2):
        self.checkpoints_dir = Path(output_dir) / "checkpoints"
        self.keep_last = keep_last

    def save(self, accelerator: "Accelerator", step: int, trainer_state: dict[str, Any]) -> Path:
        """Save a resumable checkpoint for optimizer step ``step`` (call on every rank).

        Returns:
            The final ``step-<N>`` directory.
        """
        final = self.checkpoints_dir / f"step-{step}"
        tmp = self.checkpoints_dir / f".tmp-step-{step}"
        if accelerator.is_main_process:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.checkpoints_dir.glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crash mid-write
        accelerator.wait_for_everyone()
        # Model, optimizer, scheduler, grad scaler and every rank's RNG states; under
        # DeepSpeed this writes its (sharded) engine checkpoint.
        accelerator.save_state(str(tmp), safe_serialization=True)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_json_atomic(tmp / TRAINER_STATE, {**trainer_state, "step": step})
            if final.exists():  # re-saving the same step (e.g. final step after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
        accelerator.wait_for_everyone()
        return final

    def _prune(self) -> None:
        complete = _complete_checkpoints(self.checkpoints_dir)
        for _, path in complete[: max(0, len(complete) - self.keep_last)]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, accelerator: "Accelerator", checkpoint: str | os.PathLike) -> dict[str, Any]:
        """Restore model/optimizer/scheduler/RNG from ``checkpoint``; return its trainer state."""
        accelerator.load_state(str(checkpoint))
        return read_trainer_state(checkpoint)


def _is_zero3(accelerator: "Accelerator") -> bool:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def save_final(accelerator: "Accelerator", model: "nn.Module", out_dir: str | os.PathLike, *,
               save_pretrained_extras: list[Any], metadata: dict[str, Any], merge_lora: bool = True) -> Path:
    """Write ``out_dir`` as a normal HF checkpoint (call on every rank).

    ``accelerator.get_state_dict`` gathers ZeRO-3 shards into full tensors on the main
    process, so the result is ``from_pretrained``-able, not a DeepSpeed shard folder.
    For a peft model, ``out_dir/adapter`` holds the adapter plus
    ``non_lora_trainables.safetensors`` (every trained non-LoRA weight, e.g. the
    projector), and ``out_dir`` the merged model when ``merge_lora``.

    Args:
        save_pretrained_extras: objects with ``save_pretrained`` (tokenizer, processor)
            written next to the weights.
        metadata: written to ``mmtune_run.json``.
    """
    from mmtune.training.peft_setup import is_peft_model, merged_model

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # collective under ZeRO-3
    unwrapped = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        tmp.mkdir(parents=True)
        if is_peft_model(unwrapped):
            trained = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
            unwrapped.save_pretrained(tmp / "adapter", state_dict=state_dict, safe_serialization=True)
            extra = {k: v for k, v in state_dict.items() if k in trained and "lora_" not in k}
            if extra:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in extra.items()}, str(tmp / "adapter" / "non_lora_trainables.safetensors"))
            if merge_lora and not _is_zero3(accelerator):
                merged_model(unwrapped).save_pretrained(tmp, safe_serialization=True)
            elif merge_lora:
                metadata = {**metadata, "merged": False,
                            "merged_note": "ZeRO-3 LoRA runs save the adapter only; merge it with peft offline"}
        else:
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        for extra_obj in save_pretrained_extras:
            extra_obj.save_pretrained(tmp)
        write_json_atomic(tmp / RUN_METADATA, metadata)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir

"""Run logging: Weights & Biases, a tqdm progress line, metrics.jsonl, and an MFU estimate.

Only the main process logs. The resolved config, the run name and the tags go to W&B
through :func:`mmtune.io.secrets.redact`: the value of every key that holds a secret
(``api_key``, ``hub_token``, ``db_password``, ``client_secret``, see :func:`is_secret_key`)
and every secret value of the environment found anywhere in them (a run name
interpolated from ``${oc.env:MMTUNE_JUDGE_API_KEY}``) become ``"***"``, so an API key
passed through an override never leaves the machine; names of environment variables,
cache keys and special tokens stay readable.

MFU (model FLOPs utilisation) = achieved training FLOPs / peak FLOPs, with training
FLOPs ~ 6 x N x tokens/s (forward 2N, backward 4N per token, N = parameters in the
forward pass; attention FLOPs ignored, so long-context MFU reads low). Peak numbers are
the dense bf16 tensor-core figures of the device, per GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from mmtune.io.nofollow import open_output, write_output_text
from mmtune.io.secrets import is_secret_key, redact

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.training.config import LoggingConfig

__all__ = ["is_secret_key", "redact", "peak_flops", "mfu", "step_metrics", "cut_jsonl_after", "RunLogger"]

# Dense bf16 peak FLOP/s per device (vendor datasheets, no sparsity).
_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),  # SXM; the PCIe card is 756e12
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),  # fp16 tensor cores
    ("T4", 65e12),  # fp16 tensor cores
)


def peak_flops(device_name: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s for a CUDA device name, or ``None`` when unknown."""
    for key, flops in _PEAK_BF16:
        if key.lower() in device_name.lower():
            return flops
    return None


def mfu(num_params: int, tokens_per_s: float, device_name: str, num_devices: int = 1) -> Optional[float]:
    """6·N·tokens/s over the peak of ``num_devices`` devices; ``None`` off-GPU or for unknown devices."""
    peak = peak_flops(device_name)
    if not peak or tokens_per_s <= 0:
        return None
    return 6.0 * num_params * tokens_per_s / (peak * num_devices)


def cut_jsonl_after(path: str | os.PathLike, step: int) -> int:
    """Drop the rows of a per-step JSONL log whose ``step`` is after ``step``; returns how many.

    Used on resume: the interrupted attempt logged steps past its last checkpoint, and
    the resumed run logs them again. A torn last line (the process was killed while
    writing it) is dropped too. The file is replaced atomically.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp")
        write_output_text(tmp, "".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


class RunLogger:
    """Main-process logging sink: W&B (optional), metrics.jsonl and the progress bar.

    ``secret_names``: environment variables whose values are secrets whatever their names
    (``eval.judge.api_key_env``), hidden from what goes to W&B like every secret-named one.
    """

    def __init__(self, cfg: "LoggingConfig", *, output_dir: str, resolved_config: dict[str, Any],
                 is_main: bool, total_steps: int, initial_step: int = 0, run_name: Optional[str] = None,
                 secret_names: Sequence[str] = ()):
        self.cfg = cfg
        self.is_main = is_main
        self.wandb_run = None
        self.bar = None
        self.output_dir = Path(output_dir)
        self.metrics_path = self.output_dir / "metrics.jsonl" if cfg.metrics_file else None
        if not is_main:
            return
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        if cfg.wandb:
            import wandb

            # run name and tags are config values too: an interpolated key must not name the run
            shown = redact({"name": run_name or Path(output_dir).name, "tags": list(cfg.tags),
                            "config": resolved_config}, names=secret_names)
            self.wandb_run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=shown["name"], tags=shown["tags"],
                mode=cfg.mode or os.environ.get("WANDB_MODE") or "online", config=shown["config"], dir=output_dir,
                resume="allow",
            )
        if cfg.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        if self.metrics_path is not None:
            from mmtune.io.disk import disk_full_guard
            from mmtune.training.checkpoint import intact_note

            # A line torn by a full disk is dropped on resume (cut_jsonl_after).
            with disk_full_guard(self.metrics_path, "metrics.jsonl", intact=lambda: intact_note(self.output_dir)):
                with open_output(self.metrics_path, "a") as f:
                    f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)
        if self.bar is not None:
            shown = {"loss": f"{metrics['train/loss']:.4f}", "lr": f"{metrics['train/lr']:.2e}",
                     "tok/s": f"{metrics.get('perf/tokens_per_s', 0):.0f}",
                     "img/s": f"{metrics.get('perf/images_per_s', 0):.1f}"}
            if metrics.get("perf/mfu") is not None:
                shown["mfu"] = f"{100 * metrics['perf/mfu']:.1f}%"
            self.bar.set_postfix(shown, refresh=False)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def summary(self, values: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            for k, v in values.items():
                self.wandb_run.summary[k] = v

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def step_metrics(stats: Any, *, elapsed: float, loss: float, loss_tokens: int, epoch: float,
                 lrs: list[tuple[str, float]], grad_norm: Any, mfu: Optional[float]) -> dict[str, float]:
    """One logged optimizer step's metrics.

    Args:
        stats: the step's all-reduced ``[loss sum, tokens, images]`` over every rank.
        lrs: ``(parameter group name, learning rate)``, the first one the run's ``train/lr``.
        mfu: model FLOPs utilisation, or ``None`` where the device's peak is unknown.
    """
    tokens_per_s = float(stats[1]) / elapsed
    metrics = {
        "train/loss": loss,
        "train/lr": lrs[0][1],
        "train/loss_tokens": loss_tokens,
        "train/epoch": epoch,
        "perf/tokens_per_s": tokens_per_s,
        "perf/images_per_s": float(stats[2]) / elapsed,
        "perf/step_time_s": elapsed,
    }
    for name, lr in lrs:
        metrics[f"train/lr/{name}"] = lr
    if grad_norm is not None:
        metrics["train/grad_norm"] = float(grad_norm)
    if mfu is not None:
        metrics["perf/mfu"] = mfu
    return metrics

"""Run logging: Weights & Biases, a tqdm progress line, metrics.jsonl, and an MFU estimate.

Only the main process logs. The resolved config goes to W&B with the value of every key
that holds a secret (``api_key``, ``hub_token``, ``db_password``, ``client_secret``, see
:func:`is_secret_key`) replaced by ``"***"``, so an API key passed through an override
never leaves the machine; names of environment variables, cache keys and special tokens
stay readable.

MFU (model FLOPs utilisation) = achieved training FLOPs / peak FLOPs, with training
FLOPs ~ 6 x N x tokens/s (forward 2N, backward 4N per token, N = parameters in the
forward pass; attention FLOPs ignored, so long-context MFU reads low). Peak numbers are
the dense bf16 tensor-core figures of the device, per GPU.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.training.config import LoggingConfig

__all__ = ["is_secret_key", "redact", "peak_flops", "mfu", "cut_jsonl_after", "RunLogger"]

# A key names a secret *value* when its last word is one of these ...
_SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "apikey", "credential", "credentials"})
# ... or it ends in "key"/"token" after a word that makes it a credential ("api_key",
# "hub_token"); "cache_key", "pad_token" or "image_token" are not. Keys that name where a
# secret lives ("api_key_env", "token_file") end in another word and are kept.
_CREDENTIAL_QUALIFIERS = frozenset({
    "api", "access", "auth", "bearer", "client", "hf", "hub", "huggingface", "openai", "anthropic", "azure",
    "wandb", "github", "gh", "private", "secret", "session", "refresh", "service", "signing", "encryption",
    "license", "account", "subscription", "personal", "oauth", "id", "judge",
})

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


def is_secret_key(name: Any) -> bool:
    """Whether a config key holds a secret value (an API key, token or password).

    Only the key's last words count: ``api_key``, ``hub_token``, ``db_password`` and
    ``client_secret`` do; ``api_key_env`` (the *name* of an environment variable),
    ``cache_key``, ``max_tokens``, ``pad_token`` and ``tokenizer`` do not.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower()) if w]
    if not words:
        return False
    last = words[-1]
    if last in _SECRET_WORDS:
        return True
    if last in ("key", "token"):
        return len(words) == 1 and last == "token" or (len(words) > 1 and words[-2] in _CREDENTIAL_QUALIFIERS)
    return False


def redact(value: Any) -> Any:
    """A copy of a nested dict/list with the values of secret keys (:func:`is_secret_key`) replaced by ``***``.

    Only non-empty strings are replaced: a secret is a string, and counts such as
    ``max_tokens`` stay readable.
    """
    if isinstance(value, dict):
        return {k: ("***" if is_secret_key(k) and isinstance(v, str) and v else redact(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    return value


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
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


class RunLogger:
    """Main-process logging sink: W&B (optional), metrics.jsonl and the progress bar."""

    def __init__(self, cfg: "LoggingConfig", *, output_dir: str, resolved_config: dict[str, Any],
                 is_main: bool, total_steps: int, initial_step: int = 0, run_name: Optional[str] = None):
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

            self.wandb_run = wandb.init(
                project=cfg.project, entity=cfg.entity, name=run_name or Path(output_dir).name,
                tags=list(cfg.tags), mode=cfg.mode or os.environ.get("WANDB_MODE") or "online",
                config=redact(resolved_config), dir=output_dir, resume="allow",
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
                with open(self.metrics_path, "a") as f:
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

"""Load a model to evaluate: any directory mmtune saved, or a local HF model.

Accepted ``checkpoint`` directories:

* a training run directory (``<output_dir>``): its ``final/`` is used;
* ``final/`` (full fine-tune or merged LoRA): a normal HF checkpoint + ``mmtune_run.json``;
* a peft LoRA adapter directory (``final/adapter/``, has ``adapter_config.json``): the
  base model named by the adapter (or the run's model config) is loaded, the adapter and
  any ``non_lora_trainables.safetensors`` applied, and LoRA merged for fast decoding;
* any local HF model directory, with the family from ``model.family``.

The family comes from ``mmtune_run.json`` when present, else from the given ModelConfig.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

from mmtune.models.config import ModelConfig

__all__ = ["resolve_checkpoint", "load_for_evaluation", "pick_device"]

log = logging.getLogger(__name__)
RUN_METADATA = "mmtune_run.json"


def pick_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _run_metadata(directory: Path) -> Optional[dict[str, Any]]:
    for candidate in (directory, directory.parent):
        path = candidate / RUN_METADATA
        if path.is_file():
            return json.loads(path.read_text())
    return None


def _model_config_from(metadata: Optional[dict[str, Any]], fallback: ModelConfig) -> ModelConfig:
    if not metadata:
        return dataclasses.replace(fallback)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = ((metadata.get("config") or {}).get("model") or {}) if isinstance(metadata.get("config"), dict) else {}
    values = {k: v for k, v in saved.items() if k in fields}
    if metadata.get("family"):
        values["family"] = metadata["family"]
    merged = dataclasses.asdict(fallback)
    merged.update(values)
    return ModelConfig(**merged)


def resolve_checkpoint(checkpoint: str, model_config: ModelConfig) -> tuple[ModelConfig, Optional[Path]]:
    """(model config to load, peft adapter directory or None) for a saved ``checkpoint``.

    Raises:
        FileNotFoundError: when the directory holds no model weights and no adapter.
    """
    directory = Path(checkpoint)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {checkpoint!r} is not a directory; pass a run dir, its final/ or an adapter dir")
    if (directory / "final").is_dir() and not (directory / "config.json").exists():
        directory = directory / "final"
    metadata = _run_metadata(directory)
    base = _model_config_from(metadata, model_config)
    has_weights = any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))
    if (directory / "config.json").exists() and has_weights:
        # The saved config.json describes the model; `architecture` only sizes random-weight models.
        return dataclasses.replace(base, path=str(directory), architecture={}), None
    adapter_dir = directory if (directory / "adapter_config.json").exists() else directory / "adapter"
    if (adapter_dir / "adapter_config.json").exists():
        peft_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        base_path = base.path or peft_cfg.get("base_model_name_or_path") or None
        return dataclasses.replace(base, path=base_path), adapter_dir
    raise FileNotFoundError(
        f"{directory} holds neither HF weights (config.json + *.safetensors) nor a peft adapter "
        "(adapter_config.json); point `checkpoint` at a run's final/ directory"
    )


def load_for_evaluation(
    checkpoint: Optional[str], model_config: ModelConfig, *, device: str = "auto"
) -> tuple[Any, Any, str]:
    """(adapter, model in eval mode on ``device``, label) for ``checkpoint`` or ``model_config``."""
    from mmtune.models.registry import build_adapter

    peft_dir = None
    config = model_config
    if checkpoint:
        config, peft_dir = resolve_checkpoint(checkpoint, model_config)
    adapter = build_adapter(config)
    model = adapter.load_model()
    if peft_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(peft_dir))
        extra = peft_dir / "non_lora_trainables.safetensors"
        if extra.exists():
            from safetensors.torch import load_file

            missing = model.load_state_dict(load_file(str(extra)), strict=False)
            log.info("loaded %s (%d unexpected keys)", extra, len(missing.unexpected_keys))
        model = model.merge_and_unload()  # merged weights decode as fast as the base model
    model = model.to(pick_device(device)).eval()
    label = checkpoint or config.path or f"random:{config.family}"
    return adapter, model, str(label)

"""Load a model to evaluate: any directory mmtune saved, or a local HF model.

Accepted ``checkpoint`` directories:

* a training run directory (``<output_dir>``): its ``final/`` is used;
* ``final/`` (full fine-tune or merged LoRA): a normal HF checkpoint + ``mmtune_run.json``;
* a peft LoRA adapter directory (``final/adapter/``, has ``adapter_config.json``): the
  base model named by the adapter (or the run's model config) is loaded, the adapter and
  any ``non_lora_trainables.safetensors`` applied, and LoRA merged for fast decoding;
* any local HF model directory, with the family from ``model.family``.

The family comes from ``mmtune_run.json`` when present, else from the given ModelConfig.

Remote code: a checkpoint is data from somewhere else, so it never decides whether its
own Python runs. ``trust_remote_code`` always comes from the caller's ModelConfig (never
from ``mmtune_run.json``), and when the checkpoint asks for remote code (an ``auto_map``
in its JSON configs, or a run saved with ``trust_remote_code=true``) while the caller
has not allowed it, loading stops with :class:`RemoteCodeRefused` before transformers
sees the directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

from mmtune.models.config import ModelConfig

__all__ = ["RemoteCodeRefused", "resolve_checkpoint", "load_for_evaluation", "pick_device"]

log = logging.getLogger(__name__)
RUN_METADATA = "mmtune_run.json"
# JSON files transformers reads an ``auto_map`` (remote code entry points) from.
_CODE_CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                 "image_processor_config.json", "adapter_config.json")


#: ModelConfig fields a saved run never sets for the caller
_CALLERS_OWN = ("trust_remote_code", "image_limits")


class RemoteCodeRefused(RuntimeError):
    """A checkpoint asks to run its own code and the user has not allowed remote code."""


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
    fields = ModelConfig.field_names()  # the common keys and every family's section
    saved = ((metadata.get("config") or {}).get("model") or {}) if isinstance(metadata.get("config"), dict) else {}
    # The user's safety settings always win: a checkpoint never turns remote code on, nor
    # raises the image size limits of the machine that evaluates it.
    values = {k: v for k, v in saved.items() if k in fields and k not in _CALLERS_OWN}
    if metadata.get("family"):
        values["family"] = metadata["family"]
    # a run saved by an older mmtune wrote the family keys flat (model.image_size): they load
    # into the family's section; the file is not the user's spelling, so no deprecation warning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        config = ModelConfig.from_dict({**dataclasses.asdict(fallback), **values})
    # keys the saved family does not read (a run saved by an older mmtune recorded every
    # default; the caller's config may come from another family) are dropped, not refused
    return config.without_unread_keys()


def _remote_code_requests(directory: Path, metadata: Optional[dict[str, Any]]) -> list[str]:
    """Where ``directory`` asks for remote code: ``auto_map`` entries and a saved run's setting."""
    found = []
    for name in _CODE_CONFIGS:
        path = directory / name
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # transformers reports unreadable configs itself
        auto_map = content.get("auto_map") if isinstance(content, dict) else None
        if auto_map:
            entries = ", ".join(f"{k} -> {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict) else str(auto_map)
            found.append(f"{path} has auto_map ({entries})")
    saved = ((metadata or {}).get("config") or {}) if isinstance((metadata or {}).get("config"), dict) else {}
    if isinstance(saved.get("model"), dict) and saved["model"].get("trust_remote_code") is True:
        found.append(f"its {RUN_METADATA} was saved with model.trust_remote_code=true")
    if any(directory.glob("*.py")):
        found.append(f"it ships Python files ({', '.join(sorted(p.name for p in directory.glob('*.py'))[:5])})")
    return found


def check_remote_code(directories: list[Path], metadata: Optional[dict[str, Any]], config: ModelConfig) -> None:
    """Raise :class:`RemoteCodeRefused` when a directory asks for remote code the user has not allowed."""
    if config.trust_remote_code:
        return
    found: list[str] = []
    for i, directory in enumerate(dict.fromkeys(directories)):
        if directory.is_dir():
            found += _remote_code_requests(directory, metadata if i == 0 else None)
    if found:
        raise RemoteCodeRefused(
            f"checkpoint {directories[0]} asks to run its own Python code: " + "; ".join(found) + ". mmtune does not "
            "run code that comes with a checkpoint unless you allow it: if you trust where it came from, pass "
            "model.trust_remote_code=true (recipes/evaluate.py) or --trust-remote-code (mmtune evaluate checkpoint)"
        )


def resolve_checkpoint(checkpoint: str, model_config: ModelConfig) -> tuple[ModelConfig, Optional[Path]]:
    """(model config to load, peft adapter directory or None) for a saved ``checkpoint``.

    ``trust_remote_code`` is always ``model_config``'s own.

    Raises:
        FileNotFoundError: when the directory holds no model weights and no adapter.
        RemoteCodeRefused: the checkpoint (or the base model its adapter names) asks for
            remote code and ``model_config.trust_remote_code`` is off.
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
        check_remote_code([directory], metadata, model_config)
        # The saved config.json describes the model; `architecture` only sizes random-weight models.
        return dataclasses.replace(base, path=str(directory), architecture={}), None
    adapter_dir = directory if (directory / "adapter_config.json").exists() else directory / "adapter"
    if (adapter_dir / "adapter_config.json").exists():
        peft_cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        base_path = base.path or peft_cfg.get("base_model_name_or_path") or None
        check_remote_code([directory, adapter_dir] + ([Path(base_path)] if base_path else []), metadata, model_config)
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

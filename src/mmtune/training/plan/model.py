"""The model side of the plan: parameter counts per module group, from the config alone.

The family's adapter builds the model on the meta device (no weight is read, no memory
used) and names its module groups (:meth:`~mmtune.models.base.ModelAdapter.meta_model`);
this module only finds the checkpoint's ``config.json`` and counts.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.training.plan.common import PlanError

__all__ = ["ParamCounts", "checkpoint_config", "count_parameters"]


@dataclass
class ParamCounts:
    total: int
    vision: int
    projector: int
    language_model: int
    trainable: int
    """Parameters updated by the optimizer (LoRA adapters + fully trained groups)."""
    trainable_language_model: int
    """Trainable parameters inside the language model (LoRA weights under LoRA)."""
    lora: int
    """LoRA adapter parameters (0 for full fine-tuning)."""
    hidden_size: int
    num_layers: int
    vocab_size: int
    image_tokens: Optional[int]
    """Tokens per image, when the family can say from the config (the adapter's
    ``planned_image_tokens``: the patches of a square image, a pixel-count bound)."""
    source: str
    """How the counts were obtained: meta-device build from which config."""


def checkpoint_config(model_cfg: Any) -> tuple[Optional[dict[str, Any]], str]:
    """The checkpoint's ``config.json`` as a dict and where it came from: the local
    directory, the family's known architectures (hub ids the shipped configs name), or the
    hub cache; ``(None, why)`` for a random-weight model or a checkpoint not available offline."""
    from mmtune.models.registry import adapter_class

    path = model_cfg.path
    if path is None:
        return None, "random-weight architecture from the model config"
    local = Path(os.path.expanduser(path)) / "config.json"
    if local.is_file():
        return json.loads(local.read_text(encoding="utf-8")), f"{local}"
    known = adapter_class(model_cfg.family).known_architectures
    if path in known:
        return copy.deepcopy(known[path]), f"published architecture of {path}"
    try:  # the hub cache (works offline when the checkpoint was downloaded before)
        from huggingface_hub import hf_hub_download

        cached = hf_hub_download(path, "config.json", local_files_only=True)
        return json.loads(Path(cached).read_text(encoding="utf-8")), cached
    except Exception:  # noqa: BLE001 - any failure means "not available offline"
        return None, (f"model.path={path!r} has no config.json locally and is not a known architecture; "
                      "download the checkpoint or point model.path at a local directory")


def _build_meta(model_cfg: Any):
    """``(adapter class, model, groups, config source)`` for ``model_cfg``, from the config alone."""
    from mmtune.models.registry import adapter_class

    family = adapter_class(model_cfg.family)
    config_dict, source = checkpoint_config(model_cfg)
    if model_cfg.path is not None and config_dict is None:
        raise PlanError(source)
    model, groups = family.meta_model(model_cfg, config_dict)
    return family, model, groups, source


def meta_model(model_cfg: Any):
    """``(model, groups)``: the run's model on the meta device and its module groups (the
    adapter builds both; see ``ModelAdapter.meta_model``)."""
    return _build_meta(model_cfg)[1:3]


def count_parameters(model_cfg: Any, peft_cfg: Any, training_cfg: Any) -> ParamCounts:
    """Parameter counts per module group and what trains, from the config alone."""
    family, model, groups, source = _build_meta(model_cfg)

    def n(modules) -> int:
        seen: set[int] = set()
        total = 0
        for m in modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel()
        return total

    vision, projector, lm = n(groups.vision), n(groups.projector), n(groups.language_model)
    total = sum(p.numel() for p in model.parameters())
    text = model.config.get_text_config()
    hidden = int(getattr(text, "hidden_size"))
    layers = int(getattr(text, "num_hidden_layers"))
    vocab = int(getattr(text, "vocab_size"))
    lora = 0
    if peft_cfg.method in ("lora", "qlora"):
        targets = set(peft_cfg.target_modules or family.default_lora_targets)
        lora = _lora_params(groups.language_model, targets, peft_cfg.r)
    t = training_cfg
    trainable_lm = (lora if peft_cfg.method != "none" else lm) if t.language_model.train else 0
    trainable = trainable_lm + (vision if t.vision.train else 0) + (projector if t.projector.train else 0)
    image_tokens = family.planned_image_tokens(model_cfg, model.config)
    return ParamCounts(total + lora, vision, projector, lm, trainable, trainable_lm, lora, hidden, layers, vocab,
                       image_tokens, source)


def _lora_params(modules: Sequence[Any], targets: set[str], r: int) -> int:
    from torch import nn

    total = 0
    for root in modules:
        for name, m in root.named_modules():
            if name.rsplit(".", 1)[-1] in targets and isinstance(m, nn.Linear):
                total += r * (m.in_features + m.out_features)
    return total

"""The model side of the plan: parameter counts per module group, from the config alone.

The family's adapter builds the model on the meta device (no weight is read, no memory
used) and names its module groups; this module only counts.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mmtune.training.plan.common import PlanError

__all__ = ["ParamCounts", "KNOWN_ARCHITECTURES", "checkpoint_config", "count_parameters"]

# Architectures of public checkpoints the shipped configs name by hub id, so `plan`
# counts parameters without network access or a download. A local checkpoint directory
# (or the hub cache) always wins over this table.
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llava-hf/llava-1.5-7b-hf": {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                          "patch_size": 14, "projection_dim": 768},
        "vision_feature_layer": -2,
        "image_token_index": 32000,
    },
    "llava-hf/llava-1.5-13b-hf": {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                        "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                          "patch_size": 14, "projection_dim": 768},
        "vision_feature_layer": -2,
        "image_token_index": 32000,
    },
    # The official remote-code config of the VL variant (490 px, 1225 image tokens).
    "internlm/internlm-xcomposer2-vl-7b": {
        "model_type": "internlmxcomposer2", "vocab_size": 92544, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
        "rope_scaling": {"type": "dynamic", "factor": 1.0}, "img_size": 490,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    },
}


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
    """Tokens per image, when the config says (patches of a square image)."""
    source: str
    """How the counts were obtained: meta-device build from which config."""


def checkpoint_config(model_cfg: Any) -> tuple[Optional[dict[str, Any]], str]:
    """The checkpoint's config.json as a dict, or a known architecture; (None, why) otherwise."""
    path = model_cfg.path
    if path is None:
        return None, "random-weight architecture from the model config"
    local = Path(os.path.expanduser(path)) / "config.json"
    if local.is_file():
        return json.loads(local.read_text(encoding="utf-8")), f"{local}"
    if path in KNOWN_ARCHITECTURES:
        return copy.deepcopy(KNOWN_ARCHITECTURES[path]), f"published architecture of {path}"
    try:  # the hub cache (works offline when the checkpoint was downloaded before)
        from huggingface_hub import hf_hub_download

        cached = hf_hub_download(path, "config.json", local_files_only=True)
        return json.loads(Path(cached).read_text(encoding="utf-8")), cached
    except Exception:  # noqa: BLE001 - any failure means "not available offline"
        return None, (f"model.path={path!r} has no config.json locally and is not a known architecture; "
                      "download the checkpoint or point model.path at a local directory")


def _meta_model(model_cfg: Any):
    """Build the model on the meta device (no weights read, no memory).

    Returns ``(model, source, groups)``: ``groups`` is the family's
    :class:`~mmtune.models.base.ModuleGroups` split of the model.
    """
    import torch

    # Every tensor is created on the meta device: no allocation and no initialisation
    # (accelerate's init_empty_weights still initialises on the CPU first: ~40x slower).
    init_empty_weights = lambda: torch.device("meta")  # noqa: E731

    config_dict, source = checkpoint_config(model_cfg)
    if model_cfg.path is None:
        from mmtune.models.registry import build_adapter

        adapter = build_adapter(model_cfg)
        with init_empty_weights():
            model = adapter.load_model()
        return model, source, adapter.module_groups(model)
    if config_dict is None:
        raise PlanError(source)
    if model_cfg.family == "internlm_xcomposer2":
        from mmtune.models import internlm_xcomposer2 as xc2
        from mmtune.models.base import ModuleGroups

        if config_dict.get("model_type") == xc2.InternLMXComposer2Config.model_type:
            config = xc2.InternLMXComposer2Config.from_dict(config_dict)
        else:  # the official remote-code config; Partial LoRA rank 256 as in the released weights
            config = xc2.native_config_from_official(config_dict, image_size=model_cfg.image_size, plora_r=256)
        with init_empty_weights():
            model = xc2.InternLMXComposer2ForCausalLM(config)
        return model, source, ModuleGroups(vision=[model.vit], projector=[model.vision_proj],
                                           language_model=[model.model, model.output])
    import transformers

    config = transformers.AutoConfig.for_model(**config_dict)
    with init_empty_weights():
        if model_cfg.family == "llava":
            model = transformers.LlavaForConditionalGeneration._from_config(config)
        else:
            model = transformers.AutoModelForImageTextToText.from_config(config)
    return model, source, _default_groups(model)


def count_parameters(model_cfg: Any, peft_cfg: Any, training_cfg: Any) -> ParamCounts:
    """Parameter counts per module group and what trains, from the config alone."""
    from mmtune.models.registry import adapter_class

    model, source, groups = _meta_model(model_cfg)

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
    text = _text_config(model.config)
    hidden = int(getattr(text, "hidden_size"))
    layers = int(getattr(text, "num_hidden_layers"))
    vocab = int(getattr(text, "vocab_size"))
    lora = 0
    if peft_cfg.method in ("lora", "qlora"):
        targets = set(peft_cfg.target_modules or getattr(adapter_class(model_cfg.family), "default_lora_targets", []))
        lora = _lora_params(groups.language_model, targets, peft_cfg.r)
    t = training_cfg
    trainable_lm = (lora if peft_cfg.method != "none" else lm) if t.language_model.train else 0
    trainable = trainable_lm + (vision if t.vision.train else 0) + (projector if t.projector.train else 0)
    vc = getattr(model.config, "vision_config", None)
    image_tokens = None
    if vc is not None and getattr(vc, "image_size", None) and getattr(vc, "patch_size", None):
        image_tokens = (int(vc.image_size) // int(vc.patch_size)) ** 2
    return ParamCounts(total + lora, vision, projector, lm, trainable, trainable_lm, lora, hidden, layers, vocab,
                       image_tokens, source)


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or getattr(config, "llm_config", None) or config


def _default_groups(model: Any):
    """Groups of a transformers image-text model built without an adapter (LLaVA layout:
    ``vision_tower`` / ``multi_modal_projector`` / ``language_model`` + ``lm_head``)."""
    from mmtune.models.base import ModuleGroups

    inner = getattr(model, "model", model)
    vision = [m for m in (getattr(inner, "vision_tower", None), getattr(inner, "visual", None)) if m is not None]
    projector = [m for m in (getattr(inner, "multi_modal_projector", None),) if m is not None]
    taken = {id(p) for m in vision + projector for p in m.parameters()}

    class _Rest:  # every other parameter belongs to the language model
        def parameters(self):
            return (p for p in model.parameters() if id(p) not in taken)

        def named_modules(self):
            return ((n, m) for n, m in model.named_modules()
                    if not any(n.startswith(x) for x in ("model.vision_tower", "model.visual", "model.multi_modal_projector")))

    return ModuleGroups(vision=vision, projector=projector, language_model=[_Rest()])


def _lora_params(modules: Sequence[Any], targets: set[str], r: int) -> int:
    from torch import nn

    total = 0
    for root in modules:
        for name, m in root.named_modules():
            if name.rsplit(".", 1)[-1] in targets and isinstance(m, nn.Linear):
                total += r * (m.in_features + m.out_features)
    return total

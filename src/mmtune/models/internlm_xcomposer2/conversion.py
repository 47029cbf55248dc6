"""Official InternLM-XComposer2 checkpoints -> the native model: config, state dict, tokenizer.

The official checkpoint ships as remote code; nothing of it runs here. Its ``config.json``
becomes an :class:`~.configuration.InternLMXComposer2Config`, its state dict is renamed and
its CLIP position embeddings resized (:func:`convert_official_state_dict`), and every
mismatch is listed before anything is assigned (:func:`check_state_dict`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

import torch
from torch import nn

from mmtune.models.internlm_xcomposer2.configuration import CLIP_VIT_L_14, INTERNLM2_ROPE, InternLMXComposer2Config
from mmtune.models.internlm_xcomposer2.modeling import InternLMXComposer2ForCausalLM
from mmtune.models.internlm_xcomposer2.tokenization import load_tokenizer

__all__ = [
    "CheckpointMismatchError",
    "convert_official_state_dict",
    "check_state_dict",
    "load_official_state_dict",
    "native_config_from_official",
    "is_native_checkpoint",
    "load_official_checkpoint",
    "convert_official_checkpoint",
    "convert_official_tokenizer",
]


class CheckpointMismatchError(ValueError):
    """The converted state dict does not fit the native model (lists every problem)."""


# Official keys with no native counterpart: buffers recomputed at load time and CLIP's
# post-layernorm, which the feature path never uses.
_IGNORED_OFFICIAL_KEYS = (
    re.compile(r"\.rotary_emb\.inv_freq$"),
    re.compile(r"\.position_ids$"),
    re.compile(r"^vit\.vision_tower\.(vision_model\.)?post_layernorm\."),
)
_POSITION_EMBEDDING_KEY = "vit.vision_tower.embeddings.position_embedding.weight"


def _resize_position_embedding(weight: torch.Tensor, grid: int) -> torch.Tensor:
    """Bicubic resize of CLIP's patch position embeddings to ``grid x grid``; CLS kept.

    Same operation as the official code (align_corners False), done once at load time.
    """
    old_grid = int(round((weight.shape[0] - 1) ** 0.5))
    if old_grid * old_grid != weight.shape[0] - 1:
        raise CheckpointMismatchError(
            f"{_POSITION_EMBEDDING_KEY} has {weight.shape[0]} rows, which is not 1 + a square grid"
        )
    if old_grid == grid:
        return weight
    cls, patches = weight[:1], weight[1:]
    dtype = weight.dtype
    patches = patches.float().reshape(1, old_grid, old_grid, -1).permute(0, 3, 1, 2)
    patches = nn.functional.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False)
    patches = patches.permute(0, 2, 3, 1).reshape(grid * grid, -1).to(dtype)
    return torch.cat([cls, patches], dim=0)


def convert_official_state_dict(
    state_dict: dict[str, torch.Tensor], config: InternLMXComposer2Config
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Map official parameter names/shapes onto :class:`InternLMXComposer2ForCausalLM`.

    ``vit.vision_tower.vision_model.X`` becomes ``vit.vision_tower.X`` (transformers'
    ``CLIPVisionModel`` no longer has the ``vision_model`` level), CLIP position
    embeddings are resized to the configured grid, and recomputed buffers / the unused
    post-layernorm are dropped. All other names are the same.

    Returns:
        ``(converted, ignored_keys)``.
    """
    converted: dict[str, torch.Tensor] = {}
    ignored: list[str] = []
    for key, value in state_dict.items():
        if any(pattern.search(key) for pattern in _IGNORED_OFFICIAL_KEYS):
            ignored.append(key)
            continue
        converted[key.replace("vit.vision_tower.vision_model.", "vit.vision_tower.", 1)] = value
    if _POSITION_EMBEDDING_KEY in converted:
        grid = config.vision_config.image_size // config.vision_config.patch_size
        converted[_POSITION_EMBEDDING_KEY] = _resize_position_embedding(converted[_POSITION_EMBEDDING_KEY], grid)
    return converted, ignored


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    """Raise :class:`CheckpointMismatchError` listing missing, unexpected and mis-shaped keys."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = [
        f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {expected[k]}"
        for k in sorted(set(expected) & set(state_dict))
        if tuple(state_dict[k].shape) != expected[k]
    ]
    if missing or unexpected or mismatched:
        lines = [f"the checkpoint {source} does not fit InternLMXComposer2ForCausalLM:"]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                lines.append(f"  {title} ({len(items)}): " + ", ".join(shown))
        lines.append(
            "  Check that the path holds an InternLM-XComposer2 (not 4KHD / 2.5) checkpoint and that "
            "model.internlm_xcomposer2.image_size matches the variant (490 for -vl-7b, 224 for -7b)."
        )
        raise CheckpointMismatchError("\n".join(lines))


def load_official_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read every weight shard of a checkpoint directory (safetensors preferred, then .bin).

    Follows ``*.index.json`` when present. ``.bin`` files are memory-mapped and loaded
    with ``weights_only=True`` (no pickled code runs).
    """
    from safetensors.torch import load_file

    def shards(index_name: str, single: str, pattern: str) -> list[str]:
        index = os.path.join(path, index_name)
        if os.path.exists(index):
            with open(index) as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
            return [os.path.join(path, f) for f in files]
        if os.path.exists(os.path.join(path, single)):
            return [os.path.join(path, single)]
        return sorted(glob.glob(os.path.join(path, pattern)))

    state_dict: dict[str, torch.Tensor] = {}
    files = shards("model.safetensors.index.json", "model.safetensors", "*.safetensors")
    if files:
        for file in files:
            state_dict.update(load_file(file))
        return state_dict
    files = shards("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")
    if not files:
        raise FileNotFoundError(
            f"no weights in {path}: expected model*.safetensors or pytorch_model*.bin (with or without an index json)"
        )
    for file in files:
        state_dict.update(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
    return state_dict


def native_config_from_official(
    official: dict[str, Any], *, image_size: int | None, plora_r: int | None = None
) -> InternLMXComposer2Config:
    """Build the native config from an official ``config.json`` dict.

    Args:
        official: the checkpoint's config.json (InternLM2 keys).
        image_size: vision input size (490 for -vl-7b, 224 for -7b); ``None`` reads the
            official ``img_size`` key when present.
        plora_r: Partial LoRA rank (read from ``Plora_A`` shapes by the loader).

    Raises:
        ValueError: the image size is not known.
    """
    size = image_size or official.get("img_size")
    if size is None:
        raise ValueError(
            "the official config does not say the image size; set model.internlm_xcomposer2.image_size "
            "(490 for internlm-xcomposer2-vl-7b, 224 for internlm-xcomposer2-7b)"
        )
    rope = dict(official.get("rope_scaling") or {"type": "dynamic", "factor": 1.0})
    rope = {"rope_type": rope.get("rope_type", rope.get("type", "dynamic")), "factor": float(rope.get("factor", 1.0))}
    rope["rope_theta"] = float(official.get("rope_theta", INTERNLM2_ROPE["rope_theta"]))
    text_keys = (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
        "pad_token_id",
    )  # fmt: skip
    text = {k: official[k] for k in text_keys if k in official}
    text["rope_parameters"] = rope
    if plora_r is not None:
        # Official scaling is 1.0 (alpha 256 for r 256): keep alpha = r.
        text["plora_r"], text["plora_alpha"] = int(plora_r), float(plora_r)
    vision = dict(CLIP_VIT_L_14, image_size=int(size))
    return InternLMXComposer2Config(text_config=text, vision_config=vision)


def is_native_checkpoint(path: str) -> bool:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        return False
    with open(config_file) as handle:
        return json.load(handle).get("model_type") == InternLMXComposer2Config.model_type


def load_official_checkpoint(
    path: str,
    *,
    image_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> InternLMXComposer2ForCausalLM:
    """Build the native model from an official checkpoint directory (no remote code runs).

    Parameters are created on the meta device and the converted tensors assigned to
    them, so the 8.7B model is never initialised randomly first.

    Raises:
        CheckpointMismatchError: missing / unexpected / mis-shaped keys (all listed).
    """
    from accelerate import init_empty_weights

    with open(os.path.join(path, "config.json")) as handle:
        official = json.load(handle)
    raw = load_official_state_dict(path)
    plora = next((v.shape[0] for k, v in raw.items() if k.endswith(".Plora_A.weight")), None)
    config = native_config_from_official(official, image_size=image_size, plora_r=plora)
    config._attn_implementation = attn_implementation
    state_dict, _ignored = convert_official_state_dict(raw, config)
    with init_empty_weights(include_buffers=False):
        model = InternLMXComposer2ForCausalLM(config)
    check_state_dict(model, state_dict, path)
    model.load_state_dict({k: v.to(dtype) for k, v in state_dict.items()}, strict=True, assign=True)
    model.set_attn_implementation(attn_implementation)
    return model.eval()


def convert_official_checkpoint(src: str, dst: str, *, image_size: int | None = None, dtype: str = "bfloat16") -> None:
    """Convert an official checkpoint directory to a native one (``save_pretrained`` + tokenizer files).

    The result loads with ``InternLMXComposer2ForCausalLM.from_pretrained(dst)`` and with
    ``ModelConfig(family="internlm_xcomposer2", path=dst)``.
    """
    model = load_official_checkpoint(src, image_size=image_size, dtype=getattr(torch, dtype))
    model.save_pretrained(dst)
    convert_official_tokenizer(src, dst)


def convert_official_tokenizer(src: str, dst: str) -> None:
    """Save the tokenizer of an official directory ``src`` into ``dst`` so that it loads
    without remote code and encodes as the official one: :class:`InternLM2Tokenizer` on
    its ``tokenizer.model`` (no remote-code class names in the saved config). A directory
    without ``tokenizer.model`` has its tokenizer files copied as they are."""
    import shutil

    os.makedirs(dst, exist_ok=True)
    if os.path.isfile(os.path.join(src, "tokenizer.model")):
        load_tokenizer(src, trust_remote_code=False).save_pretrained(dst)
        return
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens_map", "added_tokens")) and not name.endswith(".py"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))

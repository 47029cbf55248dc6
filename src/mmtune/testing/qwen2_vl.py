"""Tiny random-weight Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints, built locally.

There is no model hub here, so tests and CPU demos build their own checkpoints: a small
byte-level BPE trained with the ``tokenizers`` library behind transformers' own
``Qwen2Tokenizer`` (which installs Qwen's pre-tokenizer: NFC, the Qwen split regex, byte
level), the released vocabularies' special tokens in their released order, 2-layer
configs of each family, the PIL image processor, and the official chat template.

``save_tiny_checkpoint(directory, "qwen2_5_vl")`` writes a directory laid out like a hub
checkpoint (``config.json``, ``tokenizer.json``, ``preprocessor_config.json``,
``chat_template.json``, optionally random weights) that ``ModelConfig(family="qwen2_vl",
path=directory)`` and transformers' ``from_pretrained`` both load.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from mmtune.models._utils import build_random_model, deep_update
from mmtune.models.qwen2_vl.classes import MODEL_TYPES, model_classes
from mmtune.models.qwen2_vl.template import CHAT_TEMPLATES
from mmtune.testing.tokenizers import qwen_tokenizer

__all__ = [
    "SPECIAL_TOKENS",
    "TINY_ARCHITECTURES",
    "tiny_tokenizer",
    "tiny_model_config",
    "tiny_image_processor",
    "save_tiny_checkpoint",
]


#: special tokens in the order of the released Qwen2-VL vocabulary (ids 151643-151656 there)
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# 2-layer models of each family (widths 32-64). head_dim 16 -> mrope_section sums to 8:
# the (temporal, height, width) split of the rotary half-dimension, as the released configs
# split 64 ([16, 24, 24] for Qwen2-VL / Qwen2.5-VL).
_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [2, 3, 3]},
}
TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2_vl": {
        "text_config": _TEXT,
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "tie_word_embeddings": False,
    },
    "qwen2_5_vl": {
        "text_config": _TEXT,
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,  # the released value: 4 x 4 merged patches per attention window
            "fullatt_block_indexes": [1],
        },
        "tie_word_embeddings": False,
    },
    "qwen3_vl": {
        "text_config": {
            **_TEXT,
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [4, 2, 2],
                "mrope_interleaved": True,
            },
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,  # an 8 x 8 learned grid, interpolated per image
            "deepstack_visual_indexes": [0],
        },
        "tie_word_embeddings": False,
    },
}

# Processor settings of the tiny checkpoints: min_pixels = (2 x factor)^2 (4 image tokens,
# the released Qwen2-VL minimum of 56 x 56 px), max_pixels = 64 image tokens, so test images
# stay small.
_TINY_PIXELS = {"min_tokens": 4, "max_tokens": 64}


def _check_model_type(model_type: str) -> None:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not one of the qwen2_vl family's {list(MODEL_TYPES)}")


def tiny_tokenizer(vocab_size: int = 512):
    """A ``Qwen2Tokenizer`` over a BPE of ``vocab_size`` entries, plus :data:`SPECIAL_TOKENS`.

    eos ``<|im_end|>`` and pad ``<|endoftext|>`` as in the released instruct tokenizers; no
    bos, no unk (byte-level BPE encodes any text). Deterministic; a fresh object each call.
    """
    return qwen_tokenizer(SPECIAL_TOKENS, vocab_size=vocab_size, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def tiny_model_config(model_type: str, tokenizer, overrides: dict[str, Any] | None = None):
    """The family's transformers config for a tiny model: :data:`TINY_ARCHITECTURES` with
    ``overrides`` merged in (``text_config`` / ``vision_config`` / top-level keys), token
    ids from ``tokenizer``. The vision merger's output width follows the text width unless
    the overrides set it."""
    from transformers import AutoConfig

    _check_model_type(model_type)
    arch = deep_update(TINY_ARCHITECTURES[model_type], overrides)
    arch.pop("model_type", None)
    text, vision = arch["text_config"], arch["vision_config"]
    out_key = "hidden_size" if model_type == "qwen2_vl" else "out_hidden_size"
    vision.setdefault(out_key, text["hidden_size"])
    text.setdefault("vocab_size", len(tokenizer))
    text_ids = (("pad_token_id", "<|endoftext|>"), ("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|im_end|>"))
    for key, token in text_ids:
        text.setdefault(key, tokenizer.convert_tokens_to_ids(token))
    ids = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    for key, token in ids.items():
        arch.setdefault(key, tokenizer.convert_tokens_to_ids(token))
    return AutoConfig.for_model(model_type, **arch)


def tiny_image_processor(model_config: Any, *, min_pixels: int | None = None, max_pixels: int | None = None):
    """A ``Qwen2VLImageProcessorPil`` matching ``model_config``'s vision patching, with the
    tiny pixel bounds (4 to 64 image tokens) unless ``min_pixels`` / ``max_pixels`` say."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vc = model_config.vision_config
    factor = vc.patch_size * vc.spatial_merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=vc.patch_size,
        merge_size=vc.spatial_merge_size,
        temporal_patch_size=vc.temporal_patch_size,
        min_pixels=min_pixels if min_pixels is not None else _TINY_PIXELS["min_tokens"] * factor * factor,
        max_pixels=max_pixels if max_pixels is not None else _TINY_PIXELS["max_tokens"] * factor * factor,
    )


def save_tiny_checkpoint(
    directory: str,
    model_type: str = "qwen2_vl",
    *,
    architecture: dict[str, Any] | None = None,
    weights: bool = True,
    seed: int = 0,
    template: str = "processor",
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> str:
    """Write a tiny checkpoint directory of ``model_type``; returns ``directory``.

    Args:
        architecture: config overrides (as ``ModelConfig.architecture``).
        weights: also write random weights (``model.safetensors``), seeded by ``seed``.
        template: where the official chat template goes: ``"processor"`` (``chat_template.json``,
            as the released checkpoints ship it), ``"tokenizer"`` (``tokenizer_config.json``) or
            ``"none"`` (a checkpoint without a chat template).
    """
    if template not in ("processor", "tokenizer", "none"):
        raise ValueError(f"template={template!r}: use 'processor', 'tokenizer' or 'none'")
    os.makedirs(directory, exist_ok=True)
    tokenizer = tiny_tokenizer()
    config = tiny_model_config(model_type, tokenizer, architecture)
    config.save_pretrained(directory)
    if template == "tokenizer":
        tokenizer.chat_template = CHAT_TEMPLATES[model_type]
    tokenizer.save_pretrained(directory)
    processor = tiny_image_processor(config, min_pixels=min_pixels, max_pixels=max_pixels)
    processor.save_pretrained(directory)
    if template == "processor":
        with open(os.path.join(directory, "chat_template.json"), "w", encoding="utf-8") as handle:
            json.dump({"chat_template": CHAT_TEMPLATES[model_type]}, handle, indent=2)
    if weights:
        model_class = model_classes(model_type)
        model = build_random_model(
            model_class, copy.deepcopy(config), seed=seed, attn_implementation="sdpa", dtype=None
        )
        model.save_pretrained(directory)
    return directory

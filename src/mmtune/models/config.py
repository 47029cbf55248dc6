"""Typed model config (the ``model/`` config group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mmtune.data.image_limits import ImageLimits

#: families whose image processor resizes by pixel count and reads ``min_pixels`` / ``max_pixels``
PIXEL_BOUND_FAMILIES = ("qwen2_vl",)


@dataclass
class ModelConfig:
    family: str = "llava"
    """Adapter name in the registry: ``llava``, ``auto``, ``internlm_xcomposer2`` or ``qwen2_vl``."""
    path: Optional[str] = None
    """Local checkpoint directory or hub id. ``None`` builds a random-weight model from
    ``architecture`` with a built-in tiny tokenizer (tests, demo)."""
    architecture: dict[str, Any] = field(default_factory=dict)
    """Config overrides for a random-weight model (sizes of the text and vision parts)."""
    trust_remote_code: bool = False
    """Run code shipped with a checkpoint. Off unless you trust the checkpoint's source."""
    torch_dtype: str = "float32"
    """Weights dtype when loading: float32, bfloat16 or float16."""
    attn_implementation: str = "sdpa"
    """eager, sdpa or flash_attention_2 (needs the flash-attn package and a GPU)."""
    image_aspect_ratio: str = "pad"
    """LLaVA-1.5 image preprocessing: ``pad`` to a square with the mean colour (as the
    original training did) or ``resize``."""
    image_size: Optional[int] = None
    """Square input resolution; ``None`` takes the processor's / checkpoint's value."""
    label_final_eos: bool = True
    """InternLM-XComposer2: put loss on the ``\\n`` and ``</s>`` after the last answer, as the
    official fine-tuning code does (its ``mask_human_targets``). ``false`` labels only each
    answer and its ``[UNUSED_TOKEN_145]``, the tokens generation stops at."""
    max_position_embeddings: Optional[int] = None
    """Original context window of the language model; ``None`` reads it from the config."""
    min_pixels: Optional[int] = None
    """Qwen2-VL family: smallest image area (pixels) after resizing; smaller images are scaled
    up to it. ``None`` = the checkpoint processor's value. Fewer pixels = fewer image tokens."""
    max_pixels: Optional[int] = None
    """Qwen2-VL family: largest image area (pixels) after resizing, i.e. at most
    ``max_pixels / (patch_size * merge_size)^2`` tokens per image (28 px units for Qwen2-VL /
    Qwen2.5-VL, 32 px for Qwen3-VL). ``None`` = the checkpoint processor's value."""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    """Largest image files decoded, checked from each file's header before any pixel or canvas
    is allocated (a tiny PNG may declare 1 x 100000 pixels). Larger images are skipped with
    their reason in training (``data.validation.mode=skip``, found by the data check) and
    refused, naming file, dialogue and turn, in strict mode and in evaluation. A saved
    checkpoint never sets these: they are always the caller's."""

    def validate(self) -> None:
        """Raise one ValueError listing every invalid field."""
        problems = list(self.image_limits.problems())
        for key in ("min_pixels", "max_pixels"):
            value = getattr(self, key)
            if value is None:
                continue
            if value <= 0:
                problems.append(f"model.{key}={value} must be > 0 (or null for the checkpoint processor's value)")
            if self.family not in PIXEL_BOUND_FAMILIES:
                problems.append(
                    f"model.{key}={value} is set but model.family={self.family!r} does not read it (only "
                    f"{', '.join(PIXEL_BOUND_FAMILIES)} resizes images by pixel count); remove model.{key}"
                )
        if self.family in PIXEL_BOUND_FAMILIES and self.image_size is not None:
            problems.append(
                f"model.image_size={self.image_size} is not read by model.family={self.family!r}, which sizes images "
                "by pixel count: set model.image_size=null and use model.min_pixels / model.max_pixels"
            )
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            problems.append(f"model.min_pixels={self.min_pixels} is above model.max_pixels={self.max_pixels}")
        if problems:
            raise ValueError("invalid model config:\n  - " + "\n  - ".join(problems))

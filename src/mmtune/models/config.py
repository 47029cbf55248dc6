"""Typed model config (the ``model/`` config group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    family: str = "llava"
    """Adapter name in the registry: ``llava``, ``auto`` or ``internlm_xcomposer2``."""
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

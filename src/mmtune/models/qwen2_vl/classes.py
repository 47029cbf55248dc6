"""The transformers classes this family covers, by the checkpoint config's ``model_type``.

The bottom layer of the package: the template, images, tiny checkpoints and the adapter all
dispatch on ``model_type`` through this table, never on names of checkpoints.
"""

from __future__ import annotations

__all__ = ["MODEL_TYPES", "ROUTED_MODEL_TYPES", "model_classes"]

#: the ``model_type`` values of the transformers classes this family covers
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

#: later classes of the Qwen-VL line, encoded by the processor-driven ``auto`` family (their
#: processor and chat template decide the text; M-RoPE positions from the model's own rope index)
ROUTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe")

# model_type -> (generation class, inner model class owning get_rope_index)
_CLASSES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLModel"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLModel"),
}


def model_classes(model_type: str) -> tuple[type, type]:
    """transformers' ``(…ForConditionalGeneration, …Model)`` classes of ``model_type``."""
    import transformers

    if model_type not in _CLASSES:
        raise ValueError(
            f"model_type {model_type!r} is not covered by the qwen2_vl adapter; it covers {list(MODEL_TYPES)} "
            "(transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL classes)"
        )
    generation, inner = _CLASSES[model_type]
    return getattr(transformers, generation), getattr(transformers, inner)


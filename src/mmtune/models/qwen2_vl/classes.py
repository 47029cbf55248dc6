"""The transformers classes this family covers, by the checkpoint config's ``model_type``.

The bottom layer of the package: the template, images, tiny checkpoints and the adapter all
dispatch on ``model_type`` through this table, never on names of checkpoints.
"""

from __future__ import annotations

__all__ = ["MODEL_TYPES", "PROCESSORS", "model_classes", "routed_model_types"]

#: the ``model_type`` values of the transformers classes this family covers
MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

#: the processors of these classes; a later class of the Qwen-VL line is one transformers pairs with
#: one of them (its ``PROCESSOR_MAPPING_NAMES``): it is encoded by the processor-driven ``auto``
#: family (its processor and chat template decide the text; M-RoPE positions from the model's own
#: rope index), so a class transformers adds to the line is routed without a list to edit here
PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")


def routed_model_types() -> tuple[str, ...]:
    """The later classes of the line in the installed transformers (Qwen3.5, Qwen3.5-MoE,
    Qwen3-VL-MoE, Qwen4-Exp in 5.25): the ``model_type`` values paired with :data:`PROCESSORS`
    that are not :data:`MODEL_TYPES`."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    pairs = PROCESSOR_MAPPING_NAMES.items()
    return tuple(sorted(t for t, name in pairs if name in PROCESSORS and t not in MODEL_TYPES))

# model_type -> generation class (the rope index is the inner model's, found by the encoder's
# positions stage from the config: mmtune.models.positions.rope_index_for)
_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


def model_classes(model_type: str) -> type:
    """transformers' ``…ForConditionalGeneration`` class of ``model_type``."""
    import transformers

    if model_type not in _CLASSES:
        raise ValueError(
            f"model_type {model_type!r} is not covered by the qwen2_vl adapter; it covers {list(MODEL_TYPES)} "
            "(transformers' Qwen2-VL, Qwen2.5-VL and Qwen3-VL classes)"
        )
    return getattr(transformers, _CLASSES[model_type])


"""7B-shaped random-weight models for the GPU benches, with the published vocabularies.

The random-weight adapters (``model.path: null``) take mmtune's tiny byte-level BPE as
their tokenizer, whose vocabulary stops at a few hundred entries, and size the
embedding table and the output head to it. A "7B-shaped" bench built that way measures
a 512 x 4096 output layer instead of LLaVA-1.5's 32,064 x 4096 or InternLM2's
92,544 x 4096, and the output layer decides most of the loss's memory and a good part of
its time. The ``<family>_full_vocab`` families registered here are the same adapters
with the model's vocabulary set to ``model.architecture.text_config.vocab_size``: the
tokenizer's ids are the first rows, the others never occur in the data, which changes
nothing about the cost of a step.

    import seven_b                       # from a script in bench/
    seven_b.register_full_vocab_adapters()
    overrides = seven_b.overrides("llava")   # model.* overrides of the 7B shape, vocab included
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

# LLaVA-1.5-7B: Vicuna-7B v1.5 + CLIP ViT-L/14-336 (576 tokens per image) + 2-layer MLP projector.
LLAVA_7B = {
    "text_config": {"vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096,
                    "initializer_range": 0.02},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "projection_dim": 768},
}
# InternLM-XComposer2-VL-7B: InternLM2-7B with Partial LoRA r 256 + CLIP ViT-L/14-490 (1225 tokens per image).
XC2_7B = {
    "text_config": {"vocab_size": 92544, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768,
                    "plora_r": 256, "plora_alpha": 256.0},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "image_size": 490, "patch_size": 14, "projection_dim": 768},
}
SHAPES = {"llava": LLAVA_7B, "internlm_xcomposer2": XC2_7B}
# The shipped tiny model of each family, the base the 7B overrides go on.
TINY_MODELS = {"llava": "llava_tiny", "internlm_xcomposer2": "internlm_xc2_tiny"}


def register_full_vocab_adapters() -> None:
    """Register ``llava_full_vocab`` and ``internlm_xcomposer2_full_vocab`` (idempotent)."""
    from mmtune.models.registry import adapter_class, register_adapter

    for family in SHAPES:
        name = f"{family}_full_vocab"
        try:
            adapter_class(name)
        except KeyError:
            register_adapter(_full_vocab(adapter_class(family), name))


def _full_vocab(base: type, name: str) -> type:
    class FullVocab(base):
        """``base`` with the model's vocabulary from the config, not from the tiny tokenizer."""

        family = name

        def __init__(self, config):
            super().__init__(config)
            wanted = int(((config.architecture or {}).get("text_config") or {}).get("vocab_size", 0))
            text = self.text_config(self.model_config)
            if config.path is not None or wanted < text.vocab_size:
                raise ValueError(f"model.family={name} builds random weights with model.architecture.text_config."
                                 f"vocab_size >= the tokenizer's {text.vocab_size} ids; got path={config.path!r}, "
                                 f"vocab_size={wanted}")
            text.vocab_size = wanted

    FullVocab.__name__ = FullVocab.__qualname__ = f"FullVocab{base.__name__}"
    return FullVocab


def overrides(family: str, shape: dict | None = None) -> list[str]:
    """Hydra overrides that select ``family``'s full-vocabulary adapter with ``shape`` (default: the 7B one)."""
    shape = SHAPES[family] if shape is None else shape
    out = [f"model={TINY_MODELS[family]}", f"model.family={family}_full_vocab"]
    for part, values in shape.items():
        out += [f"++model.architecture.{part}.{key}={value}" for key, value in values.items()]
    return out


def describe(model, adapter) -> str:
    """One line with the shapes a bench ran with (output head included)."""
    text = adapter.text_config(model.config)
    vision = model.config.vision_config
    head = adapter.loss_modules(model)[1]
    weight = getattr(head, "weight", None)
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    return (f"{adapter.family}: {size} params; text {text.num_hidden_layers} layers x {text.hidden_size} "
            f"(heads {text.num_attention_heads}/{text.num_key_value_heads} kv, MLP {text.intermediate_size}); "
            f"output head {tuple(weight.shape) if weight is not None else type(head).__name__} "
            f"(vocab {text.vocab_size}, tokenizer {len(adapter.tokenizer)} ids); vision {vision.num_hidden_layers} "
            f"layers x {vision.hidden_size} at {vision.image_size} px / patch {vision.patch_size}")

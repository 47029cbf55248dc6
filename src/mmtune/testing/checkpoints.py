"""Tiny random-weight checkpoints of transformers' own image-text classes, built locally.

There is no model hub here, so tests, benchmarks and CPU demos of the ``auto`` family build
their checkpoints from transformers' classes: a small byte-level BPE tokenizer (the one of
:mod:`mmtune.testing.tokenizers`) holding the special tokens the class's processor and
template use, the class's processor built from its image processor (tiny image and tile
sizes), a chat template, and a 2-layer config (widths 32-64). ``save_tiny_checkpoint(directory,
"internvl")`` writes a directory that ``ModelConfig(family="auto", path=directory)`` and
transformers' ``AutoProcessor`` / ``AutoModelForImageTextToText.from_pretrained`` both load.

Each class is one :class:`~mmtune.testing.kind.TinyKind` entry of :data:`KINDS` (written in
:mod:`mmtune.testing.classes_first` and :mod:`mmtune.testing.classes`): its chat template (after
the structure of the released checkpoint's), special tokens, processor and config builders and
the released image settings; nothing here branches on a class.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from mmtune.testing.classes import CLASSES
from mmtune.testing.classes_first import FIRST
from mmtune.testing.kind import TinyKind
from mmtune.testing.tokenizers import class_tokenizer

__all__ = ["KINDS", "RELEASED_IMAGE_SETTINGS", "TinyKind", "save_tiny_checkpoint", "tiny_processor", "tiny_model_config"]

_CHATML_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 4096}  # fmt: skip

#: every tested class, one entry each, in the order tests give each its default training mode
KINDS: dict[str, TinyKind] = {**FIRST, **CLASSES}


def _check_kind(kind: str) -> TinyKind:
    if kind not in KINDS:
        raise ValueError(f"no tiny checkpoint of {kind!r}; known: {sorted(KINDS)}")
    return KINDS[kind]


def tiny_tokenizer(kind: str):
    """A fast byte-level BPE tokenizer with the class's special tokens; BOS added by the
    tokenizer (as the released Llama / Gemma / Mistral tokenizers do) where the class has one."""
    spec = _check_kind(kind)
    return class_tokenizer(spec.special_tokens, bos=spec.bos, eos=spec.eos, pad=spec.pad,
                           named_tokens=spec.named_tokens, add_bos=spec.add_bos)


#: image settings of the released checkpoints' processors (token counts and pixel work of real
#: use), for benchmarks of the text and image pipeline; the tiny models cannot run on them
RELEASED_IMAGE_SETTINGS: dict[str, dict[str, Any]] = {kind: spec.released_sizes for kind, spec in KINDS.items()}


def tiny_processor(kind: str, tokenizer=None, *, released_sizes: bool = False):
    """The class's transformers processor with tiny image sizes and :data:`KINDS`' template;
    ``released_sizes``: the image settings of the released checkpoint instead
    (:data:`RELEASED_IMAGE_SETTINGS`)."""
    spec = _check_kind(kind)
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer(kind)
    return spec.processor(tokenizer, spec.template, RELEASED_IMAGE_SETTINGS[kind] if released_sizes else None)


def tiny_model_config(kind: str, tokenizer):
    """The class's 2-layer transformers config, token ids from ``tokenizer``."""
    from transformers import AutoConfig

    spec = _check_kind(kind)
    text = {**_CHATML_TEXT, "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}  # fmt: skip
    return AutoConfig.for_model(spec.model_type, **copy.deepcopy(spec.config(tokenizer, text)))


def save_tiny_checkpoint(directory: str, kind: str, *, weights: bool = True, seed: int = 0,
                         template: bool = True, released_sizes: bool = False) -> str:
    """Write a tiny checkpoint directory of ``kind`` (one of :data:`KINDS`); returns ``directory``.

    Args:
        weights: also write random weights, seeded by ``seed``.
        template: save the chat template with the processor; ``False`` writes a checkpoint
            without one (what the ``auto`` family refuses).
        released_sizes: the processor with the released checkpoint's image settings (for
            benchmarks of data preparation; the tiny model does not match them, so no weights).

    Raises:
        ValueError: ``released_sizes`` with ``weights``.
    """
    if released_sizes and weights:
        raise ValueError("released_sizes=True writes a processor the tiny model cannot run: pass weights=False")
    from transformers import AutoModelForImageTextToText

    from mmtune.models._utils import build_random_model

    os.makedirs(directory, exist_ok=True)
    tokenizer = tiny_tokenizer(kind)
    processor = tiny_processor(kind, tokenizer, released_sizes=released_sizes)
    if not template:
        processor.chat_template = None
    processor.save_pretrained(directory)
    config = tiny_model_config(kind, tokenizer)
    config.save_pretrained(directory)
    if weights:
        model_class = AutoModelForImageTextToText._model_mapping[type(config)]
        model = build_random_model(model_class, config, seed=seed, attn_implementation="sdpa", dtype=None)
        model.save_pretrained(directory)
    spec = KINDS[kind]
    if spec.generation_eos:
        from transformers import GenerationConfig

        GenerationConfig(eos_token_id=[int(tokenizer.convert_tokens_to_ids(t)) for t in spec.generation_eos],
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         ).save_pretrained(directory)  # fmt: skip
    return directory


def _describe(kind: str) -> dict[str, Any]:  # pragma: no cover - a reading aid
    spec = KINDS[kind]
    return {"model_type": spec.model_type, "template_after": spec.released}

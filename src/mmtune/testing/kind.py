"""One transformers image-text class as a tiny checkpoint: everything a tested class needs, in one entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["TinyKind"]


@dataclass(frozen=True)
class TinyKind:
    """One transformers image-text class as a tiny checkpoint."""

    model_type: str
    template: str
    released: str
    """The released checkpoint whose template structure :attr:`template` follows."""
    special_tokens: tuple[str, ...]
    bos: str | None = None
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    named_tokens: dict[str, str] = field(default_factory=dict)
    """Tokens the processor reads from tokenizer attributes (``start_image_token`` ...)."""
    generation_eos: tuple[str, ...] = ()
    """The stop tokens of the released checkpoint's ``generation_config.json`` (``eos_token_id``),
    where they are more than the tokenizer's EOS; written with the checkpoint."""
    add_bos: bool = True
    """Whether the tokenizer adds :attr:`bos` itself (the released Llama / Gemma tokenizers do; Qwen's not)."""
    processor: Callable[[Any, str, dict[str, Any] | None], Any] = field(kw_only=True)
    """``(tokenizer, template, released image settings or None) -> processor`` (tiny sizes on ``None``)."""
    config: Callable[[Any, dict[str, Any]], dict[str, Any]] = field(kw_only=True)
    """``(tokenizer, text config defaults) -> the keyword arguments of the class's config`` (the text
    defaults: a 2-layer model of width 64, the tokenizer's vocabulary size and pad / EOS / BOS ids)."""
    released_sizes: dict[str, Any] = field(kw_only=True)
    """The image settings of the released checkpoint's processor (for benchmarks), what :attr:`processor`
    is given for ``released_sizes=True``."""
    projector_in_vision: bool = False
    """The multimodal projection sits inside the vision model (GLM-4.1V's, Qwen3-VL's ``merger``): the
    generic grouping counts it with the tower (:func:`mmtune.models.base.find_module_groups`)."""
    fidelity_reference_template: str | None = None
    """A copy of :attr:`template` with ``{% generation %}`` around each answer, for a template that is
    not prefix-stable: the fidelity tests' reference labels (transformers' assistant mask)."""

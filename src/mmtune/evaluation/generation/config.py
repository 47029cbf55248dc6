"""Typed settings of the generator (the ``eval.generation`` section): decoding, batching, overflow.

Every field has a docstring; Hydra validates YAML against this dataclass, so an unknown
key fails at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["GenerationConfig"]


@dataclass
class GenerationConfig:
    max_new_tokens: int = 2048
    """Upper bound of tokens generated per answer (MMDU's official setting is 2048)."""
    do_sample: bool = False
    """Greedy decoding (False, the MMDU protocol) or sampling with temperature/top_p."""
    temperature: float = 1.0
    """Sampling temperature; ignored when ``do_sample`` is False."""
    top_p: float = 1.0
    """Nucleus sampling mass; ignored when ``do_sample`` is False."""
    repetition_penalty: float = 1.0
    """>1 discourages repeats (XComposer2's chat used 1.005)."""
    seed: int = 0
    """Seed of the sampling generator (only used when ``do_sample``)."""
    kv_reuse: bool = True
    """Keep the KV cache across turns and feed only the new tokens (the history is a
    prefix of the next prompt). False re-encodes the whole history every turn; that path
    batches several dialogues per forward pass."""
    batch_size: Optional[int] = None
    """Dialogues decoded together. On the KV path they share one batched cache and each
    turn feeds only its new tokens; a slot whose dialogue ends takes the next one. Answers
    do not depend on it (greedy). ``None``: by model size, from ``batch_size_by_size``."""
    batch_schedule: str = "auto"
    """How rows of a batched KV cache take turns: ``continuous`` (a row starts its next
    turn as soon as its answer ends: fewest forward calls, best where decoding is bound by
    memory bandwidth, i.e. on a GPU), ``lockstep`` (rows start turns together: far less
    padding, faster where every token costs compute, i.e. on a CPU), or ``auto``
    (continuous on CUDA, lockstep elsewhere). Answers do not depend on it (greedy)."""
    batch_size_by_size: dict[str, int] = field(default_factory=lambda: {"3B": 16, "9B": 8, "20B": 4, "inf": 2})
    """Batch size for models up to each size (``"9B"``: up to 9e9 parameters). Each row
    keeps a KV cache of up to ``context_length`` tokens (LLaVA-1.5-7B in bf16: 0.5 MiB
    per token, 4 GiB per 8k dialogue), so larger models get smaller batches."""
    context_length: Optional[int] = None
    """Context window in tokens used for the overflow policy; ``None`` = the model's
    ``max_position_embeddings``. Table 5 evaluates the same model at 2k/4k/8k."""
    overflow: str = "drop_oldest"
    """What to do when prompt + ``min_new_tokens`` exceeds the window: ``drop_oldest``
    (drop the oldest exchanges, keep images later turns refer to by name) or ``stop``
    (answer no more turns of that dialogue). Recorded per turn."""
    min_new_tokens: int = 64
    """Room kept free for the answer when deciding whether a prompt fits."""
    system_prompt: Optional[str] = None
    """Overrides the chat template's system prompt (``""`` = none; ``None`` = template default)."""
    device: str = "auto"
    """``auto`` (cuda if available), ``cpu`` or ``cuda:N``."""

"""Typed settings of the generator (the ``eval.generation`` section): decoding, batching, overflow,
and the served model of the ``api`` backend (``eval.generation.api``).

Every field has a docstring; Hydra validates YAML against this dataclass, so an unknown
key fails at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["GenerationConfig", "ApiGenerationConfig", "BACKENDS"]

BACKENDS = ("local", "api")


@dataclass
class ApiGenerationConfig:
    """A model served behind an OpenAI-compatible ``/v1/chat/completions`` endpoint
    (``eval.generation.backend: api``): GPT-4o-class models, or any model vLLM or SGLang serve.

    Like the judge's, the endpoint and key come from environment variables named here,
    never from a config file."""

    model: Optional[str] = None
    """The served model's name as the endpoint knows it (``gpt-4o-2024-05-13``; for
    ``vllm serve <model>`` the name given there). Required with ``backend: api``."""
    base_url_env: str = "MMTUNE_GEN_BASE_URL"
    """Environment variable with the endpoint's base URL (``http://127.0.0.1:8000/v1`` for
    a local vLLM). Unset: ``$OPENAI_BASE_URL``, else api.openai.com."""
    api_key_env: str = "MMTUNE_GEN_API_KEY"
    """Environment variable with the API key (never logged or written anywhere). Unset:
    ``$OPENAI_API_KEY``; a local server accepts any key."""
    concurrency: int = 16
    """Dialogues in flight at once; each asks its turns in order, with its own answers in
    the history. Raise it for a local server; lower it on 429s."""
    timeout_s: float = 600.0
    """Per-request timeout; a timeout is retried. An answer of 2048 tokens can take minutes."""
    max_retries: int = 6
    """Retries on 429 / 5xx / timeouts / malformed replies before the turn counts as failed."""
    backoff_base_s: float = 1.0
    """First backoff; attempt n waits uniform(0, min(backoff_max_s, base * 2**n)) (full jitter)."""
    backoff_max_s: float = 60.0
    """Cap of one backoff wait."""
    max_reply_mb: Optional[float] = None
    """Most bytes one reply may hold, in MB, counted as received (status line, headers,
    body, an error's body too); a reply past it is cut off and the call fails with that
    reason (not retried). ``null``: 64 KiB plus 64 bytes per requested token
    (``mmtune.evaluation.chat_api.reply_cap``; 192 KiB for 2048 tokens), many times a
    real answer and far below a runaway server's."""
    max_failed_share: float = 0.0
    """Largest share of turns allowed to fail (an error after retries, or an empty answer)
    before the evaluation exits with an error; results, details and the report are written
    first. 0.0: any failed turn is an error. A re-run asks the failed turns again."""
    max_image_side: Optional[int] = 2048
    """Longest image side sent, in pixels. OpenAI's high-detail input scales an image to fit
    a 2048 x 2048 square anyway (its vision guide), so larger pixels only cost upload bytes.
    ``null``: no cap."""
    max_image_mb: float = 20.0
    """Largest image file sent, in MB (OpenAI's chat API takes up to 20 MB per image, 50 MB
    of images per request)."""
    oversize: str = "downscale"
    """An image above ``max_image_side`` or ``max_image_mb``: ``downscale`` (aspect kept,
    re-encoded; the turn's record says so) or ``refuse`` (the turn fails, naming the image)."""
    prices: dict[str, Any] = field(
        default_factory=lambda: {
            "gpt-4o": {"input": 2.5, "output": 10.0},
            "gpt-4o-mini": {"input": 0.15, "output": 0.6},
        }
    )
    """USD per million input / output tokens, by model name (longest matching prefix wins);
    the estimated cost goes into each result's ``meta.generation_usage``."""


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
    """``auto`` (cuda if available; each rank's own GPU in a data-parallel run), ``cpu`` or ``cuda:N``."""
    backend: str = "local"
    """Who answers: ``local`` (the checkpoint's model, here, on the batched KV path; several
    processes split the dialogues) or ``api`` (a served model, ``eval.generation.api``; no
    checkpoint is loaded, ``system_prompt`` and the decoding settings are sent with each
    request, the batching and window settings do not apply)."""
    api: ApiGenerationConfig = field(default_factory=ApiGenerationConfig)

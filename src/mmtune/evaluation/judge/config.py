"""Typed settings of the LLM judge (the ``eval.judge`` section).

Secrets are not config: the judge's base URL and key are read from the environment
variables *named* here, never stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["JudgeConfig"]


@dataclass
class JudgeConfig:
    model: Optional[str] = None
    """Judge model name (e.g. ``gpt-4o-2024-05-13``); ``None`` reads the env var ``model_env``."""
    model_env: str = "MMTUNE_JUDGE_MODEL"
    """Environment variable holding the judge model name when ``model`` is unset."""
    base_url_env: str = "MMTUNE_JUDGE_BASE_URL"
    """Environment variable with the OpenAI-compatible base URL (unset = api.openai.com)."""
    api_key_env: str = "MMTUNE_JUDGE_API_KEY"
    """Environment variable with the API key. The key is never logged or written anywhere.
    When this variable and ``base_url_env`` are unset, the openai SDK's own
    ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL`` are used (the start-up line names the source)."""
    max_failed_share: float = 0.0
    """Largest share of judge calls allowed to fail (after retries) before the evaluation
    exits with an error. 0.0 = any failed call is an error: a judge that fails must never
    look like a model that scored zero. Results and details are written first either way."""
    max_unparsed_share: float = 0.05
    """Largest share of judge replies allowed to be unreadable as scores (no complete score
    set, a value out of range, content that is not text) before the evaluation exits with an
    error; a benchmark that retries unparsed replies (MM-Vet) counts an item once, after its
    last try. Unparsed items score 0, so past a few of them the figure measures the judge
    prompt or parser, not the model. Results and details are written first either way."""
    stop_after_failures: int = 20
    """Stop sending once this many calls failed and none succeeded (bad key, wrong URL,
    server down): the remaining items fail at once instead of paying retries each."""
    concurrency: int = 8
    """Judge calls in flight at once. Raise it for a local vLLM server; lower it on 429s."""
    timeout_s: float = 120.0
    """Wall-clock limit of one attempt, in seconds: connecting, sending the request and
    receiving the whole reply must be done within it (a server that trickles its reply a byte
    at a time is cut off too, not only one that goes silent). A timed-out attempt is retried;
    the longest one item can take is about ``(max_retries + 1) * timeout_s`` plus the backoffs."""
    max_retries: int = 6
    """Retries on 429 / 5xx / timeouts / malformed replies before the item counts as failed."""
    backoff_base_s: float = 1.0
    """First backoff; attempt n waits uniform(0, min(backoff_max_s, base * 2**n)) (full jitter)."""
    backoff_max_s: float = 60.0
    """Cap of one backoff wait."""
    max_tokens: int = 2048
    """Max tokens of a judge reply."""
    max_reply_mb: Optional[float] = None
    """Most bytes one reply may hold, in MB, counted as received (status line, headers,
    body, an error's body too); a reply past it is cut off and the call fails with that
    reason (not retried). ``null``: 64 KiB plus 64 bytes per requested token
    (``mmtune.evaluation.chat_api.reply_cap``; 192 KiB for 2048 tokens), many times a
    real answer and far below a runaway server's."""
    send_images: bool = False
    """Attach the item's images to judge calls (MMDU's official judge does; VLMEvalKit's
    port does not). Off = text-only judging, which needs no image files."""
    check_first: bool = True
    """Before generating answers for a judged benchmark, send the judge one request of one
    token: a wrong key, model name or URL then fails in seconds, not after the generation.
    The check is not cached (a few tokens on every run)."""
    cache_path: Optional[str] = None
    """SQLite cache of judge replies; ``None`` = ``<output_dir>/judge_cache.sqlite``."""
    prices: dict[str, Any] = field(
        default_factory=lambda: {
            "gpt-4o": {"input": 2.5, "output": 10.0},
            "gpt-4o-mini": {"input": 0.15, "output": 0.6},
            "gpt-4-0613": {"input": 30.0, "output": 60.0},
        }
    )
    """USD per million input / output tokens, by model name (longest matching prefix wins)."""

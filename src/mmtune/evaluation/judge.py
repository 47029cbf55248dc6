"""LLM-judge client: any OpenAI-compatible endpoint, bounded concurrency, retries, on-disk cache.

The endpoint, model name and key come from environment variables (names configurable
in :class:`~mmtune.evaluation.config.JudgeConfig`); the key is handed to the ``openai``
SDK and nowhere else: not to logs, results, configs or W&B.

Every reply is stored in an SQLite cache as soon as it arrives, keyed by a hash of
(judge model, messages, image contents, decoding settings, run index). A re-run or a
resume after a crash therefore pays only for calls that never completed; multi-run
protocols (MM-Vet's 5 runs) put the run index in the key so each run is a real call.

Retries are our own loop (the SDK's are switched off) so the policy is explicit and
testable: 429, 5xx, timeouts, connection errors and malformed replies are retried with
exponential backoff and full jitter; other 4xx errors fail the item at once.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import mimetypes
import os
import random
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mmtune.evaluation.config import JudgeConfig

__all__ = ["JudgeRequest", "JudgeResponse", "JudgeStats", "JudgeCache", "JudgeClient", "JudgeError"]

log = logging.getLogger(__name__)


class JudgeError(RuntimeError):
    """A judge call that cannot succeed (bad request, auth, missing settings)."""


@dataclass(frozen=True)
class JudgeRequest:
    """One judge call. ``images`` are file paths, attached only when the client sends images."""

    prompt: str
    system: Optional[str] = None
    images: tuple[str, ...] = ()
    temperature: float = 0.0
    max_tokens: Optional[int] = None
    run_index: int = 0
    """Distinguishes repeated judging of the same prompt (MM-Vet's N runs)."""


@dataclass
class JudgeResponse:
    content: Optional[str]
    """The reply text; ``None`` when the call failed after all retries."""
    cached: bool = False
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.content is not None


@dataclass
class JudgeStats:
    """Counters of one client's lifetime (thread-safe through the client's lock)."""

    calls: int = 0
    """HTTP requests sent (including retried ones)."""
    completed: int = 0
    """Requests that returned a usable reply (what you pay for)."""
    retries: int = 0
    failed: int = 0
    """Items given up on after all retries, or rejected with a non-retryable error."""
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _image_upload(path: str) -> tuple[str, bytes]:
    """``(mime type, bytes)`` of an image file to attach to a judge call.

    The file must decode as an image header (PIL) whatever its name says: only image
    files ever leave the machine, never a file an image path happens to point at.
    """
    from PIL import Image as PILImage

    try:
        with PILImage.open(path) as image:
            kind = image.format
    except Exception as err:  # PIL raises many types for files that are not images
        raise ValueError(
            f"judge.send_images: {path} is not an image file ({type(err).__name__}: {err}); only image files are "
            "sent to the judge. Fix the image path in the benchmark data or turn send_images off"
        ) from None
    mime = PILImage.MIME.get(kind or "", mimetypes.guess_type(path)[0] or "image/png")
    return mime, Path(path).read_bytes()


class JudgeCache:
    """Append-only SQLite store of judge replies. Safe across threads and processes
    (WAL mode; each write commits at once so a SIGKILL loses only calls in flight)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
        self._conn.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a committed reply survives a killed process (what resume needs)
        # without an fsync per reply; only an OS crash / power cut can lose the latest ones.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, model TEXT, content TEXT,"
            " prompt_tokens INTEGER, completion_tokens INTEGER, created REAL)"
        )
        self._conn.commit()

    def get(self, key: str) -> Optional[tuple[str, int, int]]:
        with self._lock:
            row = self._conn.execute(
                "SELECT content, prompt_tokens, completion_tokens FROM replies WHERE key = ?", (key,)
            ).fetchone()
        return None if row is None else (row[0], int(row[1]), int(row[2]))

    def put(self, key: str, model: str, content: str, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?, ?, ?)",
                (key, model, content, prompt_tokens, completion_tokens, time.time()),
            )
            self._conn.commit()

    def __len__(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: Optional[float] = None):
        super().__init__(reason)
        self.retry_after = retry_after


class JudgeClient:
    """Thread-pooled judge caller.

    Args:
        config: judge settings; endpoint and key are read from the env vars it names.
        cache_path: SQLite cache file (overrides ``config.cache_path``); ``None`` and no
            config path = no cache.
        env: environment mapping to read (defaults to ``os.environ``; tests pass a dict).
        sleep, rng: injected for tests (backoff waits and jitter).

    Raises:
        JudgeError: when no judge model name is configured.
    """

    def __init__(
        self,
        config: JudgeConfig,
        *,
        cache_path: Optional[str | os.PathLike] = None,
        env: Optional[dict[str, str]] = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: Optional[random.Random] = None,
    ):
        import openai

        env = os.environ if env is None else env
        self.config = config
        self.model = config.model or env.get(config.model_env)
        if not self.model:
            raise JudgeError(
                f"no judge model: set judge.model in the eval config or the environment variable {config.model_env}"
            )
        api_key = env.get(config.api_key_env) or "EMPTY"  # local servers accept any key
        base_url = env.get(config.base_url_env) or None
        self._secret = api_key if api_key != "EMPTY" else None
        # max_retries=0: our loop below owns retries, so backoff and counting are in one place.
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=config.timeout_s, max_retries=0)
        path = cache_path if cache_path is not None else config.cache_path
        self.cache = JudgeCache(path) if path else None
        self.stats = JudgeStats()
        self._lock = threading.Lock()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._digests: dict[str, str] = {}

    # ----------------------------------------------------------------- keys and messages
    def _image_digest(self, path: str) -> str:
        if path not in self._digests:
            self._digests[path] = _file_digest(path)
        return self._digests[path]

    def cache_key(self, request: JudgeRequest) -> str:
        """Hash of everything that changes the reply: model, messages, image bytes, decoding, run."""
        images = [self._image_digest(p) for p in request.images] if self.config.send_images else []
        payload = {
            "model": self.model,
            "system": request.system,
            "prompt": request.prompt,
            "images": images,
            "temperature": request.temperature,
            "max_tokens": request.max_tokens or self.config.max_tokens,
            "run": request.run_index,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()

    def _messages(self, request: JudgeRequest) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        if self.config.send_images and request.images:
            content: list[dict[str, Any]] = [{"type": "text", "text": request.prompt}]
            for path in request.images:
                mime, raw = _image_upload(path)
                data = base64.b64encode(raw).decode("ascii")
                content.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}})
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": request.prompt})
        return messages

    def _redact(self, text: str) -> str:
        return text.replace(self._secret, "***") if self._secret else text

    # ----------------------------------------------------------------- one call
    def _price(self) -> tuple[float, float]:
        best = ""
        for name in self.config.prices:
            if self.model.startswith(name) and len(name) > len(best):
                best = name
        if not best:
            return 0.0, 0.0
        price = self.config.prices[best]
        return float(price.get("input", 0.0)), float(price.get("output", 0.0))

    def _attempt(self, request: JudgeRequest) -> tuple[str, int, int]:
        import openai

        with self._lock:
            self.stats.calls += 1
        try:
            completion = self._client.chat.completions.create(
                model=self.model,
                messages=self._messages(request),
                temperature=request.temperature,
                max_tokens=request.max_tokens or self.config.max_tokens,
            )
        except openai.RateLimitError as err:
            raise _Retryable("HTTP 429 rate limited", _retry_after(err)) from None
        except openai.InternalServerError as err:
            raise _Retryable(f"HTTP {err.status_code} server error") from None
        except openai.APITimeoutError:
            raise _Retryable(f"timeout after {self.config.timeout_s}s") from None
        except openai.APIConnectionError as err:
            raise _Retryable(f"connection error: {type(err).__name__}") from None
        except (openai.APIResponseValidationError, json.JSONDecodeError) as err:
            # Proxies and overloaded servers sometimes answer 200 with an HTML or truncated body.
            raise _Retryable(f"malformed reply: {type(err).__name__}") from None
        except openai.APIStatusError as err:
            raise JudgeError(
                f"judge endpoint rejected the request with HTTP {err.status_code}: "
                f"{self._redact(str(err.message))[:300]}. Check the model name ({self.model!r}), "
                f"the key in ${self.config.api_key_env} and the URL in ${self.config.base_url_env}."
            ) from None
        # A 200 with a body that is not a chat completion (proxies, broken servers) is retried.
        choices = getattr(completion, "choices", None)
        if not choices or getattr(choices[0], "message", None) is None or choices[0].message.content is None:
            raise _Retryable("malformed reply: no choices[0].message.content")
        usage = getattr(completion, "usage", None)
        return (
            choices[0].message.content,
            int(getattr(usage, "prompt_tokens", 0) or 0),
            int(getattr(usage, "completion_tokens", 0) or 0),
        )

    def judge(self, request: JudgeRequest) -> JudgeResponse:
        """Answer ``request`` from the cache or the endpoint; never raises for transient errors."""
        key = self.cache_key(request)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                with self._lock:
                    self.stats.cache_hits += 1
                return JudgeResponse(hit[0], cached=True, prompt_tokens=hit[1], completion_tokens=hit[2])
        last = "no attempt made"
        for attempt in range(self.config.max_retries + 1):
            try:
                content, p_tok, c_tok = self._attempt(request)
            except _Retryable as err:
                last = str(err)
                if attempt == self.config.max_retries:
                    break
                cap = min(self.config.backoff_max_s, self.config.backoff_base_s * (2**attempt))
                wait = self._rng.uniform(0, cap)
                if err.retry_after is not None:
                    wait = max(wait, min(err.retry_after, self.config.backoff_max_s))
                with self._lock:
                    self.stats.retries += 1
                log.debug("judge call failed (%s); retry %d in %.2fs", last, attempt + 1, wait)
                self._sleep(wait)
                continue
            except JudgeError as err:
                with self._lock:
                    self.stats.failed += 1
                return JudgeResponse(None, error=str(err))
            if self.cache is not None:
                self.cache.put(key, self.model, content, p_tok, c_tok)
            p_in, p_out = self._price()
            with self._lock:
                self.stats.completed += 1
                self.stats.prompt_tokens += p_tok
                self.stats.completion_tokens += c_tok
                self.stats.cost_usd += (p_tok * p_in + c_tok * p_out) / 1e6
            return JudgeResponse(content, prompt_tokens=p_tok, completion_tokens=c_tok)
        with self._lock:
            self.stats.failed += 1
        message = f"judge call failed after {self.config.max_retries + 1} attempts; last error: {last}"
        log.warning(message)
        return JudgeResponse(None, error=message)

    def judge_many(
        self, requests: Sequence[JudgeRequest], *, progress: bool = False, desc: str = "judging"
    ) -> list[JudgeResponse]:
        """Judge all ``requests`` with at most ``config.concurrency`` in flight; results in input order."""
        from tqdm.auto import tqdm

        results: list[Optional[JudgeResponse]] = [None] * len(requests)
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool, tqdm(
            total=len(requests), desc=desc, disable=not progress
        ) as bar:
            futures = {pool.submit(self.judge, req): i for i, req in enumerate(requests)}
            from concurrent.futures import as_completed

            for future in as_completed(futures):
                results[futures[future]] = future.result()
                bar.update(1)
        return [r for r in results if r is not None]

    def close(self) -> None:
        self._client.close()
        if self.cache is not None:
            self.cache.close()


def _retry_after(err: Any) -> Optional[float]:
    response = getattr(err, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None

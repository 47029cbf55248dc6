"""LLM-judge client: any OpenAI-compatible endpoint, bounded concurrency, retries, on-disk cache.

The endpoint, model name and key come from environment variables (names configurable
in :class:`~mmtune.evaluation.judge.config.JudgeConfig`); the key is handed to the ``openai``
SDK and nowhere else: not to logs, results, configs or W&B.

Every reply is stored in an SQLite cache as soon as it arrives, keyed by a hash of
(judge model, messages, image contents, decoding settings, run index). A re-run or a
resume after a crash therefore pays only for calls that never completed; multi-run
protocols (MM-Vet's 5 runs) put the run index in the key so each run is a real call.

Retries are our own loop (the SDK's are switched off) so the policy is explicit and
testable: 429, 5xx, timeouts, connection errors and malformed replies are retried with
exponential backoff and full jitter; other 4xx errors fail the item at once.

Failures are loud: each failed call keeps its HTTP status and (redacted) message, the
stats keep the first error and a count per likely cause, and :func:`check_failures`
raises :class:`JudgeFailures` naming the cause (key, model/URL, server) when more than
``max_failed_share`` of the calls failed. Two evaluations sharing one cache file never
pay twice for a request in flight: the first claims the key in the cache, the second
waits for its reply.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import mimetypes
import os
import random
import re
import socket
import sqlite3
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from mmtune.evaluation.judge.config import JudgeConfig
from mmtune.evaluation.judge.deadline import deadline

__all__ = [
    "JudgeRequest",
    "JudgeResponse",
    "JudgeStats",
    "JudgeCache",
    "JudgeClient",
    "JudgeError",
    "JudgeFailures",
    "likely_cause",
    "check_failures",
    "check_unparsed",
    "resolve_endpoint",
]

log = logging.getLogger(__name__)


class JudgeError(RuntimeError):
    """A judge call that cannot succeed (bad request, auth, missing settings)."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


class JudgeFailures(RuntimeError):
    """Too many judge calls failed: the scores would mix real zeros with failures."""


def likely_cause(status: Optional[int], message: str, *, key_source: str = "the API key variable",
                 url_source: str = "the base URL variable") -> str:
    """A one-line diagnosis of a failed judge call, for the summary a user reads first."""
    text = message.lower()
    if status in (401, 403):
        return f"the API key is wrong, expired or lacks access: check {key_source}"
    if status == 404:
        return f"the judge model name or the base URL is wrong (the endpoint does not know it): check judge.model and {url_source}"
    if status == 429:
        return "rate limit or quota exhausted: lower judge.concurrency or check the account's quota"
    if status is not None and status >= 500:
        return "the judge server failed (HTTP 5xx): retry later or check the server's log"
    if "refused" in text or "connection error" in text or "connect" in text:
        return f"no server answered at the base URL (connection refused): start the judge server or fix {url_source}"
    if "timeout" in text:
        return "the judge server did not answer in time: raise judge.timeout_s or check the server's load"
    if "malformed" in text:
        return "the endpoint answered with something that is not a chat completion: check the base URL points at an OpenAI-compatible /v1"
    if status == 400:
        return "the endpoint rejected the request (HTTP 400): check the judge model supports these messages (images?) and max_tokens"
    return "see the error message"


def resolve_endpoint(config: JudgeConfig, env: Any) -> tuple[str, Optional[str], str, str]:
    """(api key, base URL, key source, url source): mmtune's variables first, then the
    openai SDK's ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL``. Sources are variable names only.

    Surrounding whitespace is stripped from both (a pasted key often ends in ``\\r``).

    Raises:
        SecretError: the key holds whitespace inside it (the message names the variable only).
    """
    from mmtune.io.secrets import clean_secret

    key, key_source, key_var = env.get(config.api_key_env), f"${config.api_key_env}", config.api_key_env
    if not (key or "").strip() and (env.get("OPENAI_API_KEY") or "").strip():
        key, key_source, key_var = env.get("OPENAI_API_KEY"), "$OPENAI_API_KEY", "OPENAI_API_KEY"
    key = clean_secret(key, key_var) if key else ""
    if not key:
        key, key_source = "EMPTY", f"none (${config.api_key_env} and $OPENAI_API_KEY unset; local servers accept any key)"
    url, url_source = (env.get(config.base_url_env) or "").strip(), f"${config.base_url_env}"
    if not url and (env.get("OPENAI_BASE_URL") or "").strip():
        url, url_source = env.get("OPENAI_BASE_URL").strip(), "$OPENAI_BASE_URL"
    if not url:
        url, url_source = None, f"the openai default (${config.base_url_env} and $OPENAI_BASE_URL unset)"
    return key, url, key_source, url_source


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
    model: Optional[str] = None
    """Judge model for this call (a benchmark's own protocol judge); ``None`` = the client's."""


@dataclass
class JudgeResponse:
    content: Optional[str]
    """The reply text; ``None`` when the call failed after all retries."""
    cached: bool = False
    error: Optional[str] = None
    """What went wrong (key redacted) when the call failed."""
    status: Optional[int] = None
    """HTTP status of the failure, when the endpoint answered."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    unreadable: Optional[str] = None
    """Why the reply has no text to parse (its content was an object, a number or null); then
    ``content`` is ``""`` and the benchmark counts the reply as unparsed with this reason."""

    def error_record(self) -> Optional[dict[str, Any]]:
        """``{"status", "message"}`` for the details file, or None when the call succeeded."""
        return None if self.ok else {"status": self.status, "message": self.error}

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
    unreadable: int = 0
    """Replies whose content was not text (an object, a number, null): unparsed, never cached."""
    requests: int = 0
    """Items asked for (served from cache, completed or failed)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    first_error: Optional[dict[str, Any]] = None
    """The first failure: status, message (redacted) and likely cause."""
    causes: dict[str, int] = field(default_factory=dict)
    """Failed calls counted by likely cause."""

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["causes"] = dict(self.causes)
        return out

    @property
    def failed_share(self) -> float:
        return self.failed / self.requests if self.requests else 0.0

    def summary(self) -> str:
        """One paragraph for the console: counts, first error and its likely cause."""
        line = (f"judge: {self.requests} requests, {self.completed} completed, {self.cache_hits} from cache, "
                f"{self.failed} failed ({100 * self.failed_share:.1f}%), {self.retries} retries")
        if self.first_error:
            err = self.first_error
            status = f"HTTP {err['status']}: " if err.get("status") else ""
            line += f"\n  first error: {status}{err['message']}\n  likely cause: {err['cause']}"
        return line


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _image_upload(path: str, limits: Any = None) -> tuple[str, bytes]:
    """``(mime type, bytes)`` of an image file to attach to a judge call.

    The file must decode as an image header (PIL) whatever its name says: only image
    files ever leave the machine, never a file an image path happens to point at. Its
    header's size must be within ``limits`` (``model.image_limits``): a judge server
    decodes what it is sent.

    Raises:
        ValueError: not an image file, or one above the limits (:class:`ImageTooLargeError`).
    """
    from PIL import Image as PILImage

    from mmtune.data.image_limits import ImageLimits, ImageTooLargeError

    try:
        (limits or ImageLimits()).check_file(path)
        with PILImage.open(path) as image:
            kind = image.format
    except ImageTooLargeError as err:
        raise ImageTooLargeError(err.path, err.size, f"{err.reason}; judge.send_images sends no such image") from None
    except Exception as err:  # PIL raises many types for files that are not images
        raise ValueError(
            f"judge.send_images: {path} is not an image file ({type(err).__name__}: {err}); only image files are "
            "sent to the judge. Fix the image path in the benchmark data or turn send_images off"
        ) from None
    mime = PILImage.MIME.get(kind or "", mimetypes.guess_type(path)[0] or "image/png")
    return mime, Path(path).read_bytes()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JudgeCache:
    """Append-only SQLite store of judge replies. Safe across threads and processes
    (WAL mode; each write commits at once so a SIGKILL loses only calls in flight).

    A second table holds *claims*: the key of a request some caller is sending right now.
    Another evaluation that needs the same reply waits for it instead of paying again.
    A claim is dropped when its owner finishes (reply stored or failure), when its owner
    process on this host is gone (a killed run), or after ``stale_after`` seconds.
    """

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
        self._conn.execute("CREATE TABLE IF NOT EXISTS claims (key TEXT PRIMARY KEY, owner TEXT, host TEXT, pid INTEGER, claimed REAL)")
        self._conn.commit()
        self._host = socket.gethostname()

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
            self._conn.execute("DELETE FROM claims WHERE key = ?", (key,))
            self._conn.commit()

    def claim(self, key: str, owner: str, *, stale_after: float) -> bool:
        """True when ``owner`` now holds ``key`` (nobody else is sending that request)."""
        with self._lock:
            now = time.time()
            row = self._conn.execute("SELECT host, pid, claimed FROM claims WHERE key = ?", (key,)).fetchone()
            if row is not None:
                host, pid, claimed = row
                if now - float(claimed) > stale_after or (host == self._host and not _pid_alive(int(pid))):
                    self._conn.execute("DELETE FROM claims WHERE key = ?", (key,))
            cursor = self._conn.execute(
                "INSERT OR IGNORE INTO claims VALUES (?, ?, ?, ?, ?)", (key, owner, self._host, os.getpid(), now)
            )
            self._conn.commit()
            return cursor.rowcount == 1

    def release(self, key: str, owner: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, owner))
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
        image_limits: largest images attached to a call (``model.image_limits``; default: the defaults).

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
        image_limits: Any = None,
    ):
        import openai

        from mmtune.evaluation.judge.deadline import install_deadline
        from mmtune.io.secrets import Redactor, environment_secrets

        env = os.environ if env is None else env
        self.config = config
        self.model = config.model or env.get(config.model_env)
        if not self.model:
            raise JudgeError(
                f"no judge model: set judge.model in the eval config or the environment variable {config.model_env}"
            )
        api_key, base_url, self.key_source, self.url_source = resolve_endpoint(config, env)
        self.base_url = base_url
        # The key in every spelling a message may carry it in (repr, JSON, URL-encoded, cut
        # short), and every other secret of the environment, e.g. echoed by a proxy's error page.
        self._redactor = Redactor([api_key] if api_key != "EMPTY" else [], min_chars=1)
        self._redactor.add(environment_secrets(env, [config.api_key_env]))
        # timeout_s bounds the whole call (connect to last byte), not each read: see judge/deadline.py
        http_client = openai.DefaultHttpxClient()
        install_deadline(http_client)
        # max_retries=0: our loop below owns retries, so backoff and counting are in one place.
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=config.timeout_s, max_retries=0,
                                     http_client=http_client)
        path = cache_path if cache_path is not None else config.cache_path
        self.cache = JudgeCache(path) if path else None
        self.stats = JudgeStats()
        self._lock = threading.Lock()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._digests: dict[str, str] = {}
        self._image_limits = image_limits
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        # longest a live caller can hold a claim: every attempt times out and every backoff is maximal
        self._stale_after = (config.max_retries + 1) * config.timeout_s + config.max_retries * config.backoff_max_s + 60

    def describe(self) -> str:
        """The start-up line: model, endpoint and where each came from; never the key."""
        url = self.base_url or "https://api.openai.com/v1"
        return (f"judge: model {self.model!r} at {url} (URL from {self.url_source}; key from {self.key_source}); "
                f"failures allowed: {100 * self.config.max_failed_share:g}% of calls")

    # ----------------------------------------------------------------- keys and messages
    def _image_digest(self, path: str) -> str:
        if path not in self._digests:
            self._digests[path] = _file_digest(path)
        return self._digests[path]

    def cache_key(self, request: JudgeRequest) -> str:
        """Hash of everything that changes the reply: model, messages, image bytes, decoding, run."""
        images = [self._image_digest(p) for p in request.images] if self.config.send_images else []
        payload = {
            "model": request.model or self.model,
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
                mime, raw = _image_upload(path, self._image_limits)
                data = base64.b64encode(raw).decode("ascii")
                content.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}})
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": request.prompt})
        return messages

    def _redact(self, text: str) -> str:
        return self._redactor.text(text)

    # ----------------------------------------------------------------- one call
    def _price(self, model: str) -> tuple[float, float]:
        best = ""
        for name in self.config.prices:
            if model.startswith(name) and len(name) > len(best):
                best = name
        if not best:
            return 0.0, 0.0
        price = self.config.prices[best]
        return float(price.get("input", 0.0)), float(price.get("output", 0.0))

    def _attempt(self, request: JudgeRequest) -> tuple[str, int, int]:
        import openai

        with self._lock:
            self.stats.calls += 1
        messages = self._messages(request)
        try:
            with deadline(self.config.timeout_s):
                completion = self._client.chat.completions.create(
                    model=request.model or self.model,
                    messages=messages,
                    temperature=request.temperature,
                    max_tokens=request.max_tokens or self.config.max_tokens,
                )
        except openai.RateLimitError as err:
            raise _Retryable("HTTP 429 rate limited", _retry_after(err)) from None
        except openai.InternalServerError as err:
            raise _Retryable(f"HTTP {err.status_code} server error") from None
        except openai.APITimeoutError:
            raise _Retryable(f"timeout: no complete reply within {self.config.timeout_s}s") from None
        except openai.APIConnectionError as err:
            raise _Retryable(f"connection error: {_root_cause(err)}") from None
        except (openai.APIResponseValidationError, json.JSONDecodeError) as err:
            # Proxies and overloaded servers sometimes answer 200 with an HTML or truncated body.
            raise _Retryable(f"malformed reply: {type(err).__name__}") from None
        except openai.APIStatusError as err:
            raise JudgeError(
                f"judge endpoint rejected the request with HTTP {err.status_code}: "
                f"{self._redact(str(err.message))[:300]} (model {request.model or self.model!r})",
                status=err.status_code,
            ) from None
        # A 200 with a body that is not a chat completion (proxies, broken servers) is retried.
        choices = getattr(completion, "choices", None)
        message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices else None
        if message is None:
            raise _Retryable("malformed reply: no choices[0].message")
        usage = getattr(completion, "usage", None)
        return (
            getattr(message, "content", None),
            _count(getattr(usage, "prompt_tokens", 0)),
            _count(getattr(usage, "completion_tokens", 0)),
        )

    def _fail(self, message: str, status: Optional[int]) -> JudgeResponse:
        message = self._redact(message)
        cause = likely_cause(status, message, key_source=self.key_source, url_source=self.url_source)
        with self._lock:
            self.stats.failed += 1
            self.stats.causes[cause] = self.stats.causes.get(cause, 0) + 1
            if self.stats.first_error is None:
                self.stats.first_error = {"status": status, "message": message, "cause": cause}
        return JudgeResponse(None, error=message, status=status)

    def _hit(self, hit: tuple[str, int, int]) -> JudgeResponse:
        with self._lock:
            self.stats.cache_hits += 1
        # redacted again: a cache written before the key was known to the redactor may hold it
        return JudgeResponse(self._redact(hit[0]), cached=True, prompt_tokens=hit[1], completion_tokens=hit[2])

    def judge(self, request: JudgeRequest) -> JudgeResponse:
        """Answer ``request`` from the cache or the endpoint; never raises for transient errors."""
        with self._lock:
            self.stats.requests += 1
        key = self.cache_key(request)
        if self.cache is not None:
            hit = self.cache.get(key)
            if hit is not None:
                return self._hit(hit)
            # another evaluation on this cache may be sending the same request: wait for its reply
            while not self.cache.claim(key, self._owner, stale_after=self._stale_after):
                time.sleep(0.05)
                hit = self.cache.get(key)
                if hit is not None:
                    return self._hit(hit)
            hit = self.cache.get(key)  # stored between our miss and our claim
            if hit is not None:
                self.cache.release(key, self._owner)
                return self._hit(hit)
        response = None
        try:
            response = self._send(request, key)
            return response
        finally:
            if self.cache is not None and (response is None or not response.ok or response.unreadable):
                self.cache.release(key, self._owner)  # a stored reply already dropped the claim

    def _send(self, request: JudgeRequest, key: str) -> JudgeResponse:
        limit = self.config.stop_after_failures
        with self._lock:
            hopeless = limit > 0 and self.stats.completed == 0 and self.stats.failed >= limit
            first = dict(self.stats.first_error or {})
        if hopeless:
            return self._fail(f"not sent: the first {limit} judge calls all failed (first: {first.get('message')})",
                              first.get("status"))
        last, status = "no attempt made", None
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
                return self._fail(str(err), err.status)
            p_in, p_out = self._price(request.model or self.model)
            unreadable = _unreadable(content)
            with self._lock:
                self.stats.completed += 1
                self.stats.unreadable += unreadable is not None
                self.stats.prompt_tokens += p_tok
                self.stats.completion_tokens += c_tok
                self.stats.cost_usd += (p_tok * p_in + c_tok * p_out) / 1e6
            if unreadable is not None:  # paid for, but nothing to store or parse
                log.warning("judge reply without text: %s", unreadable)
                return JudgeResponse("", prompt_tokens=p_tok, completion_tokens=c_tok, unreadable=unreadable)
            # A judge may echo the key (a prompt-injected answer, a proxy's error page): it is
            # hidden before the reply is stored anywhere, the cache included.
            content = self._redact(_storable(content))
            if self.cache is not None:
                self.cache.put(key, request.model or self.model, content, p_tok, c_tok)
            return JudgeResponse(content, prompt_tokens=p_tok, completion_tokens=c_tok)
        match = re.search(r"HTTP (\d{3})", last)
        status = int(match.group(1)) if match else None
        message = f"judge call failed after {self.config.max_retries + 1} attempts; last error: {last}"
        log.warning(self._redact(message))
        return self._fail(message, status)

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


def _count(value: Any) -> int:
    """A token count from a reply's ``usage``; anything that is not a count is 0."""
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError, OverflowError):
        return 0


def _unreadable(content: Any) -> Optional[str]:
    """Why a reply's ``message.content`` is no text to parse, or None when it is a string."""
    if isinstance(content, str):
        return None
    if content is None:
        return "the reply's message content is null (no text: a refusal or a tool call?)"
    shown = json.dumps(content, default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"the reply's message content is a JSON {_JSON_TYPES.get(type(content), type(content).__name__)} ({shown}), not text"


_JSON_TYPES = {dict: "object", list: "array", int: "number", float: "number", bool: "boolean"}


def _storable(text: str) -> str:
    """``text`` as UTF-8 can store it: an escape such as ``\\ud800`` (half of a surrogate pair)
    decodes to no character, and SQLite refuses it; it is kept spelled out."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _retry_after(err: Any) -> Optional[float]:
    response = getattr(err, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _root_cause(err: BaseException) -> str:
    """The innermost exception's text (``[Errno 111] Connection refused``) of a connection error."""
    seen = err
    while seen.__cause__ is not None or seen.__context__ is not None:
        seen = seen.__cause__ or seen.__context__
    text = str(seen) or type(seen).__name__
    return text if seen is err else f"{type(seen).__name__}: {text}"


def check_failures(stats: JudgeStats, config: JudgeConfig, *, benchmark: str) -> None:
    """Raise :class:`JudgeFailures` when more than ``config.max_failed_share`` of the calls failed.

    Called after the benchmark's results and details are written, so nothing paid for is lost.
    """
    if stats.failed == 0 or stats.failed_share <= config.max_failed_share:
        return
    raise JudgeFailures(
        f"{benchmark}: {stats.failed} of {stats.requests} judge calls failed after retries "
        f"(allowed: {100 * config.max_failed_share:g}%); failed items are scored 0, so these "
        f"scores are not a measure of the model.\n{stats.summary()}\n"
        "Results and per-item errors are written; fix the cause and re-run: completed judge replies "
        "come from the cache. Raise eval.judge.max_failed_share to accept some failures."
    )


def check_unparsed(result: Any, config: JudgeConfig) -> None:
    """Raise :class:`JudgeFailures` when more than ``config.max_unparsed_share`` of a judged
    benchmark's replies could not be read as scores.

    ``result`` is the benchmark's :class:`~mmtune.evaluation.results.BenchmarkResult`; a judged
    benchmark counts its items scored from a reply (``counts["valid"]``) and those whose reply
    gave no score (``counts["unparsed"]``), and may list why in ``meta["unparsed_reasons"]``
    (reason -> count). Called after the results and details are written, like :func:`check_failures`.
    """
    unparsed = int(result.counts.get("unparsed", 0) or 0)
    replied = unparsed + int(result.counts.get("valid", 0) or 0)
    if not unparsed or unparsed / replied <= config.max_unparsed_share:
        return
    reasons = result.meta.get("unparsed_reasons") or {}
    shown = "".join(f"\n  - {n} x {reason}" for reason, n in list(reasons.items())[:5])
    raise JudgeFailures(
        f"{result.benchmark}: {unparsed} of {replied} judge replies gave no usable score "
        f"(allowed: {100 * config.max_unparsed_share:g}%); those items are scored 0, so these scores are not a "
        f"measure of the model.{' Why:' + shown if shown else ''}\n"
        "Results and per-item replies are written (details/): check the judge model and prompt suit the benchmark's "
        "score format, or raise eval.judge.max_unparsed_share (--max-unparsed-share) to accept some."
    )

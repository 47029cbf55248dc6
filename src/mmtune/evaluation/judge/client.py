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


CONNECT_TIMEOUT_S = 10.0
"""Longest wait for a connection to the judge; reading a reply has ``judge.timeout_s``."""
CHECK_TIMEOUT_S = 15.0
"""Longest wait for the one-token check of :meth:`JudgeClient.check`."""

#: how a failed name lookup reads (socket.gaierror on Linux, macOS, Windows)
_DNS_FAILURES = ("gaierror", "name or service not known", "nodename nor servname", "temporary failure in name resolution",
                 "getaddrinfo failed", "no address associated with hostname", "name resolution")


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
    if any(mark in text for mark in _DNS_FAILURES):
        return (f"the host name in the base URL does not resolve (DNS failure): check the host in {url_source}, "
                "or this machine's network and DNS")
    if "refused" in text:
        return f"no server answered at the base URL (connection refused): start the judge server or fix {url_source}"
    if "connection error" in text or "connect" in text:
        return (f"could not connect to the base URL (no route, a firewall or a proxy in the way): check {url_source} "
                "and that the server is reachable from this machine")
    if "timeout" in text:
        return "the judge server did not answer in time: raise judge.timeout_s or check the server's load"
    if "malformed" in text:
        return "the endpoint answered with something that is not a chat completion: check the base URL points at an OpenAI-compatible /v1"
    if status == 400:
        return "the endpoint rejected the request (HTTP 400): check the judge model supports these messages (images?) and max_tokens"
    return "see the error message"


def resolve_endpoint(config: JudgeConfig, env: Any) -> tuple[str, Optional[str], str, str]:
    """(api key, base URL, key source, url source): mmtune's variables first, then the
    openai SDK's ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL``. Sources are variable names only."""
    key, key_source = env.get(config.api_key_env), f"${config.api_key_env}"
    if not key and env.get("OPENAI_API_KEY"):
        key, key_source = env.get("OPENAI_API_KEY"), "$OPENAI_API_KEY"
    if not key:
        key, key_source = "EMPTY", f"none (${config.api_key_env} and $OPENAI_API_KEY unset; local servers accept any key)"
    url, url_source = env.get(config.base_url_env), f"${config.base_url_env}"
    if not url and env.get("OPENAI_BASE_URL"):
        url, url_source = env.get("OPENAI_BASE_URL"), "$OPENAI_BASE_URL"
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
        import httpx
        import openai

        env = os.environ if env is None else env
        self.config = config
        self.model = config.model or env.get(config.model_env)
        if not self.model:
            raise JudgeError(
                f"no judge model: set judge.model in the eval config or the environment variable {config.model_env}"
            )
        api_key, base_url, self.key_source, self.url_source = resolve_endpoint(config, env)
        self.base_url = base_url
        self._secret = api_key if api_key != "EMPTY" else None
        # max_retries=0: our loop below owns retries, so backoff and counting are in one place.
        # Connecting gets at most CONNECT_TIMEOUT_S: a host that drops packets would otherwise
        # hold every attempt for the whole timeout_s (7 x 120 s per call).
        timeout = httpx.Timeout(config.timeout_s, connect=min(CONNECT_TIMEOUT_S, config.timeout_s))
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=timeout, max_retries=0)
        path = cache_path if cache_path is not None else config.cache_path
        self.cache = JudgeCache(path) if path else None
        self.stats = JudgeStats()
        self._lock = threading.Lock()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._digests: dict[str, str] = {}
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        # longest a live caller can hold a claim: every attempt times out and every backoff is maximal
        self._stale_after = (config.max_retries + 1) * config.timeout_s + config.max_retries * config.backoff_max_s + 60

    def describe(self, role: str = "judge") -> str:
        """The start-up line: model, endpoint and where each came from; never the key.
        ``role`` names what the client is (the data builder's ``teacher``)."""
        url = self.base_url or "https://api.openai.com/v1"
        line = f"{role}: model {self.model!r} at {url} (URL from {self.url_source}; key from {self.key_source})"
        return line + (f"; failures allowed: {100 * self.config.max_failed_share:g}% of calls" if role == "judge" else "")

    def check(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """Send one request of one token, so a wrong key, model name or URL stops the run
        now rather than after hours of generation. Not cached and not counted in
        :attr:`stats`. A rate limit or a server error passes (the endpoint and key
        answered; the run's retries handle those).

        Raises:
            JudgeError: naming what failed and its likely cause.
        """
        import openai

        url = self.base_url or "https://api.openai.com/v1"
        try:
            self._client.with_options(timeout=min(timeout_s, self.config.timeout_s)).chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": "Reply with the word OK."}],
                max_tokens=1, temperature=0)
            return
        except (openai.RateLimitError, openai.InternalServerError) as err:
            log.warning("judge check: HTTP %s from %s; going on, calls will be retried", err.status_code, url)
            return
        except openai.APITimeoutError:
            status, message = None, f"timeout after {min(timeout_s, self.config.timeout_s):g}s"
        except openai.APIConnectionError as err:
            status, message = None, f"connection error: {_root_cause(err)}"
        except openai.APIStatusError as err:
            status, message = err.status_code, f"HTTP {err.status_code}: {self._redact(str(err.message))[:300]}"
        cause = likely_cause(status, message, key_source=self.key_source, url_source=self.url_source)
        raise JudgeError(f"the judge (model {self.model!r} at {url}) failed a one-token test request before "
                         f"anything was generated: {message}. Likely cause: {cause}", status=status)

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
        try:
            completion = self._client.chat.completions.create(
                model=request.model or self.model,
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
        if not choices or getattr(choices[0], "message", None) is None or choices[0].message.content is None:
            raise _Retryable("malformed reply: no choices[0].message.content")
        usage = getattr(completion, "usage", None)
        return (
            choices[0].message.content,
            int(getattr(usage, "prompt_tokens", 0) or 0),
            int(getattr(usage, "completion_tokens", 0) or 0),
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
        return JudgeResponse(hit[0], cached=True, prompt_tokens=hit[1], completion_tokens=hit[2])

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
            if self.cache is not None and (response is None or not response.ok):
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
            if self.cache is not None:
                self.cache.put(key, request.model or self.model, content, p_tok, c_tok)
            p_in, p_out = self._price(request.model or self.model)
            with self._lock:
                self.stats.completed += 1
                self.stats.prompt_tokens += p_tok
                self.stats.completion_tokens += c_tok
                self.stats.cost_usd += (p_tok * p_in + c_tok * p_out) / 1e6
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

"""LLM-judge client: any OpenAI-compatible endpoint, bounded concurrency, retries, on-disk cache.

The endpoint, model name and key come from environment variables (names configurable
in :class:`~mmtune.evaluation.judge.config.JudgeConfig`); the key is handed to the ``openai``
SDK and nowhere else: not to logs, results, configs or W&B.

Every reply is stored in an SQLite cache (:mod:`.cache`) as soon as it arrives, keyed by a hash of
(judge model, messages, image contents, decoding settings, run index). A re-run or a
resume after a crash therefore pays only for calls that never completed; multi-run
protocols (MM-Vet's 5 runs) put the run index in the key so each run is a real call.

Calls go through :class:`~mmtune.evaluation.chat_api.ChatEndpoint` (shared with the
``api`` generation backend): retries are our own loop (the SDK's are switched off) so the
policy is explicit and testable: 429, 5xx, timeouts, connection errors and malformed
replies are retried with exponential backoff and full jitter; other 4xx errors fail the
item at once. The key is redacted from every message and tokens and cost are counted there.

Failures are loud: each failed call keeps its HTTP status and (redacted) message, the
stats keep the first error and a count per likely cause, and :func:`check_failures`
raises :class:`JudgeFailures` naming the cause (key, model/URL, server) when more than
``max_failed_share`` of the calls failed. Two evaluations sharing one cache file never
pay twice for a request in flight: the first claims the key in the cache, the second
waits for its reply.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

from mmtune.evaluation.chat_api import (CHECK_TIMEOUT_S, CONNECT_TIMEOUT_S, JUDGE, CallStats, ChatEndpoint, Role,
                                       EndpointCheckFailed, image_data_url, likely_cause, open_image,
                                       resolve_endpoint)
from mmtune.evaluation.judge.cache import JudgeCache
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
    "check_unparsed",
    "CHECK_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
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


@dataclass(frozen=True)
class JudgeRequest:
    """One judge call. ``images`` are file paths, or image segments whose ``root`` confines
    them (:class:`~mmtune.data.dialogue.Image`), attached only when the client sends images."""

    prompt: str
    system: Optional[str] = None
    images: tuple[Any, ...] = ()
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
class JudgeStats(CallStats):
    """Counters of one judge client's lifetime (see :class:`~mmtune.evaluation.chat_api.CallStats`)."""

    label: ClassVar[str] = "judge"
    unreadable: int = 0
    """Replies whose content was not text (an object, a number, null): unparsed, never cached."""


def _path_and_root(image: Any) -> tuple[str, Optional[str]]:
    """``(path, image root)`` of a request's image: a path string is not confined."""
    return (image, None) if isinstance(image, str) else (image.path, image.root)


class JudgeClient:
    """Thread-pooled judge caller.

    Args:
        config: judge settings; endpoint and key are read from the env vars it names.
        cache_path: SQLite cache file (overrides ``config.cache_path``); ``None`` and no
            config path = no cache.
        env: environment mapping to read (defaults to ``os.environ``; tests pass a dict).
        sleep, rng: injected for tests (backoff waits and jitter).
        image_limits: largest images attached to a call (``model.image_limits``; default: the defaults).
        role: who answers, in the words its messages use (the data builder's teacher passes ``TEACHER``).

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
        role: Role = JUDGE,
    ):
        env = os.environ if env is None else env
        self.config = config
        self.model = config.model or env.get(config.model_env)
        if not self.model:
            raise JudgeError(
                f"no judge model: set judge.model in the eval config or the environment variable {config.model_env}"
            )
        self.stats = JudgeStats()
        self._endpoint = ChatEndpoint(config, env=env, role=role, stats=self.stats, rng=rng)
        # base_url as shown (credentials in it as ***); the endpoint alone holds the real one
        self.base_url, self.key_source, self.url_source = (self._endpoint.shown_url, self._endpoint.key_source,
                                                           self._endpoint.url_source)
        path = cache_path if cache_path is not None else config.cache_path
        self.cache = JudgeCache(path) if path else None
        self._lock = self._endpoint.lock
        self._sleep = sleep
        self._digests: dict[str, str] = {}
        self._image_limits = image_limits
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
        # longest a live caller can hold a claim: every attempt times out and every backoff is maximal
        self._stale_after = (config.max_retries + 1) * config.timeout_s + config.max_retries * config.backoff_max_s + 60

    def describe(self, role: str = "judge") -> str:
        """The start-up line: model, endpoint and where each came from; never the key.
        ``role`` names what the client is (the data builder's ``teacher``)."""
        line = f"{role}: model {self.model!r} at {self._endpoint.where()}"
        return line + (f"; failures allowed: {100 * self.config.max_failed_share:g}% of calls" if role == "judge" else "")

    def check(self, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """Send one request of one token, so a wrong key, model name or URL stops the run
        now rather than after hours of generation. Not cached and not counted in
        :attr:`stats`. A rate limit or a server error passes (the endpoint and key
        answered; the run's retries handle those).

        Raises:
            JudgeError: naming what failed and its likely cause.
        """
        try:
            self._endpoint.check(self.model, timeout_s)
        except EndpointCheckFailed as err:
            raise JudgeError(str(err), status=err.status) from None

    # ----------------------------------------------------------------- keys and messages
    def _image_digest(self, image: Any) -> str:
        path, root = _path_and_root(image)
        if path not in self._digests:
            self._digests[path] = hashlib.sha256(open_image(path, root)).hexdigest()
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
            for image in request.images:
                path, root = _path_and_root(image)
                raw = open_image(path, root)  # one open, inside its root, at the moment it is sent
                _check_image_size(path, raw, self._image_limits)  # a judge server decodes what it is sent
                url, _ = image_data_url(path, max_side=None, max_bytes=None, oversize="downscale",
                                        setting="judge.send_images", receiver="the judge",
                                        remedy="Fix the image path in the benchmark data or turn send_images off",
                                        data=raw)
                content.append({"type": "image_url", "image_url": {"url": url}})
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": request.prompt})
        return messages

    def _hit(self, hit: tuple[str, int, int]) -> JudgeResponse:
        with self._lock:
            self.stats.cache_hits += 1
        # redacted again: a cache written before the key was known to the redactor may hold it
        return JudgeResponse(self._endpoint.redact(hit[0]), cached=True, prompt_tokens=hit[1],
                             completion_tokens=hit[2])

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
            reply = self._endpoint.fail(f"not sent: the first {limit} judge calls all failed (first: "
                                        f"{first.get('message')})", first.get("status"))
            return JudgeResponse(None, error=reply.error, status=reply.status)
        model = request.model or self.model
        reply = self._endpoint.complete(model, self._messages(request), temperature=request.temperature,
                                        max_tokens=request.max_tokens or self.config.max_tokens, sleep=self._sleep)
        if not reply.ok:
            return JudgeResponse(None, error=reply.error, status=reply.status)
        if reply.unreadable is not None:  # paid for, but nothing to store or parse
            with self._lock:
                self.stats.unreadable += 1
            log.warning("judge reply without text: %s", reply.unreadable)
            return JudgeResponse("", prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens,
                                 unreadable=reply.unreadable)
        # A judge may echo the key (a prompt-injected answer, a proxy's error page): the endpoint
        # hid it before the reply reaches the cache or any file.
        content = _storable(reply.content)
        if self.cache is not None:
            self.cache.put(key, model, content, reply.prompt_tokens, reply.completion_tokens)
        return JudgeResponse(content, prompt_tokens=reply.prompt_tokens, completion_tokens=reply.completion_tokens)

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
        self._endpoint.close()
        if self.cache is not None:
            self.cache.close()


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


def _check_image_size(path: str, raw: bytes, limits: Any) -> None:
    """Refuse to attach an image (``raw``, the bytes read from ``path``) whose header states a
    size above ``limits`` (``model.image_limits``)."""
    from PIL import Image as PILImage

    from mmtune.core.images import ImageLimits, ImageTooLargeError, header_size

    try:
        try:
            width, height = header_size(io.BytesIO(raw))
        except PILImage.DecompressionBombError as err:  # above twice PIL.Image.MAX_IMAGE_PIXELS
            raise ImageTooLargeError(path, None, f"PIL refuses it: {err}") from None
        (limits or ImageLimits()).check(path, width, height)
    except ImageTooLargeError as err:
        raise ImageTooLargeError(err.path, err.size, f"{err.reason}; judge.send_images sends no such image") from None
    except Exception:  # noqa: BLE001 - not an image: image_data_url says so, naming the setting
        return


def _storable(text: str) -> str:
    """``text`` as UTF-8 can store it: an escape such as ``\\ud800`` (half of a surrogate pair)
    decodes to no character, and SQLite refuses it; it is kept spelled out."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


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
        "score format, or raise eval.judge.max_unparsed_share to accept some."
    )

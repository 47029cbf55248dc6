"""Calls to an OpenAI-compatible chat endpoint, shared by the LLM judge and the ``api`` generation backend.

What both callers need lives here once: where the endpoint and key come from (the
environment variables a caller's settings name, then the openai SDK's own), a retry loop
of our own (the SDK's are switched off so the policy is explicit and testable: 429, 5xx,
timeouts, connection errors and malformed replies are retried with exponential backoff
and full jitter, honouring ``Retry-After``; other 4xx fail at once), the key redacted from
every message, tokens and an estimated cost counted per call (a price table in USD per
million tokens), a one-line diagnosis of a failure, and images sent as data URLs (only
files that decode as images, opened inside their image root, ever leave the machine).

Every reply is bounded in size: a call may receive at most :func:`reply_cap` bytes (derived
from the request's ``max_tokens``, or the settings' ``max_reply_mb``), counted as they come
off the connection (:func:`mmtune.io.deadline.byte_cap`), so an error body, a body that never
ends or one that declares more in its ``Content-Length`` is cut off there and the call fails
with that reason (not retried: the same request would get the same answer). Replies are asked
uncompressed (``Accept-Encoding: identity``) and a compressed one is refused unread: a few
kilobytes of gzip can expand to gigabytes.

What is asked and what is kept is the caller's: the judge adds its cache of replies
(:mod:`mmtune.evaluation.judge.client`), the generator its per-turn records
(:mod:`mmtune.evaluation.generation.api`).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import mimetypes
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional

from mmtune.io.deadline import deadline

__all__ = ["Role", "JUDGE", "SERVED_MODEL", "TEACHER", "CONNECT_TIMEOUT_S", "CHECK_TIMEOUT_S", "EndpointCheckFailed",
           "REPLY_BYTES_PER_TOKEN", "REPLY_OVERHEAD_BYTES", "reply_cap", "likely_cause", "resolve_endpoint",
           "CallStats", "ChatReply", "ChatEndpoint", "ImageRefused", "ImageTooLarge", "ImageOutsideRoot", "open_image",
           "image_upload", "image_data_url"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Role:
    """Who answers at the endpoint, in the words and config keys its messages use."""

    noun: str
    """``judge`` / ``model``: "judge call failed", "model endpoint rejected"."""
    section: str
    """The config section whose keys the messages name (``judge.concurrency``)."""
    server: str
    model: str


JUDGE = Role("judge", "judge", "judge server", "judge model")
SERVED_MODEL = Role("model", "generation.api", "model server", "served model")
TEACHER = Role("teacher", "teacher", "teacher server", "teacher model")
"""The data builder's teacher (``mmtune data build``), called through the judge's client."""


CONNECT_TIMEOUT_S = 10.0
"""Longest wait for a connection to an endpoint; reading a reply has the settings' ``timeout_s``."""
CHECK_TIMEOUT_S = 15.0
"""Longest wait for the one-token check of :meth:`ChatEndpoint.check`."""

REPLY_BYTES_PER_TOKEN = 64
"""Bytes of reply allowed per requested token. An English token is about 4 characters of text
(OpenAI's rule of thumb, "What are tokens and how to count them"); written as JSON, a
character outside ASCII takes up to 12 bytes escaped (``\\uXXXX``, twice beyond the BMP), and vocabularies
hold tokens of long runs of spaces or punctuation. 64 leaves room for all of these and is
still a small bound: 2 MB of reply for 32k tokens."""
REPLY_OVERHEAD_BYTES = 64 * 1024
"""Bytes allowed besides the answer's tokens: status line, headers and the JSON envelope
(id, model, usage, a server's extra fields), and an error's body."""


def reply_cap(settings: Any, max_tokens: int) -> int:
    """The most bytes one call may receive: ``settings.max_reply_mb`` when set, else
    :data:`REPLY_OVERHEAD_BYTES` + :data:`REPLY_BYTES_PER_TOKEN` x ``max_tokens``
    (a 2048-token answer: 192 KiB)."""
    mb = getattr(settings, "max_reply_mb", None)
    if mb:
        return max(1, int(mb * 1e6))
    return REPLY_OVERHEAD_BYTES + REPLY_BYTES_PER_TOKEN * max(1, int(max_tokens))

#: how a failed name lookup reads (socket.gaierror on Linux, macOS, Windows)
_DNS_FAILURES = ("gaierror", "name or service not known", "nodename nor servname", "temporary failure in name resolution",
                 "getaddrinfo failed", "no address associated with hostname", "name resolution")


def likely_cause(status: Optional[int], message: str, *, key_source: str = "the API key variable",
                 url_source: str = "the base URL variable", role: Role = JUDGE) -> str:
    """A one-line diagnosis of a failed call, for the summary a user reads first."""
    text = message.lower()
    if status in (401, 403):
        return f"the API key is wrong, expired or lacks access: check {key_source}"
    if status == 404:
        return (f"the {role.model} name or the base URL is wrong (the endpoint does not know it): check "
                f"{role.section}.model and {url_source}")
    if status == 429:
        return f"rate limit or quota exhausted: lower {role.section}.concurrency or check the account's quota"
    if status is not None and status >= 500:
        return f"the {role.server} failed (HTTP 5xx): retry later or check the server's log"
    if "than the cap of" in text:
        return (f"the {role.server} sent far more than max_tokens can produce (a runaway or broken server): check "
                f"the server, or raise {role.section}.max_reply_mb if its replies are that large by design")
    if "reply is compressed" in text:
        return f"the {role.server} (or a proxy) compresses replies although none was asked: turn its compression off"
    if any(mark in text for mark in _DNS_FAILURES):
        return (f"the host name in the base URL does not resolve (DNS failure): check the host in {url_source}, "
                "or this machine's network and DNS")
    if "refused" in text:
        return f"no server answered at the base URL (connection refused): start the {role.server} or fix {url_source}"
    if "connection error" in text or "connect" in text:
        return (f"could not connect to the base URL (no route, a firewall or a proxy in the way): check {url_source} "
                "and that the server is reachable from this machine")
    if "timeout" in text:
        return f"the {role.server} did not answer in time: raise {role.section}.timeout_s or check the server's load"
    if "malformed" in text:
        return "the endpoint answered with something that is not a chat completion: check the base URL points at an OpenAI-compatible /v1"
    if status == 400:
        return (f"the endpoint rejected the request (HTTP 400): check the {role.model} supports these messages "
                "(images?) and max_tokens")
    return "see the error message"


def resolve_endpoint(config: Any, env: Any) -> tuple[str, Optional[str], str, str]:
    """(api key, base URL, key source, url source) from the variables ``config`` names
    (``api_key_env``, ``base_url_env``), then the openai SDK's ``OPENAI_API_KEY`` /
    ``OPENAI_BASE_URL``. Sources are variable names only, never values.

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


@dataclass
class CallStats:
    """Counters of one endpoint's lifetime (thread-safe through the endpoint's lock)."""

    label: ClassVar[str] = "calls"
    """How :meth:`summary` names the caller."""

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
        line = (f"{self.label}: {self.requests} requests, {self.completed} completed, {self.cache_hits} from cache, "
                f"{self.failed} failed ({100 * self.failed_share:.1f}%), {self.retries} retries")
        if self.first_error:
            err = self.first_error
            status = f"HTTP {err['status']}: " if err.get("status") else ""
            line += f"\n  first error: {status}{err['message']}\n  likely cause: {err['cause']}"
        return line


@dataclass
class ChatReply:
    """One chat call's outcome after retries."""

    content: Optional[str]
    """The reply text; ``None`` when the call failed after all retries."""
    error: Optional[str] = None
    """What went wrong (key redacted) when the call failed."""
    status: Optional[int] = None
    """HTTP status of the failure, when the endpoint answered."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    """The endpoint's ``finish_reason`` (``stop``, ``length`` ...)."""
    cause: Optional[str] = None
    """The failure's likely cause (:func:`likely_cause`)."""
    unreadable: Optional[str] = None
    """Why a completed call has no text (its content was an object, a number or null); then
    ``content`` is ``""``. Paid for, not retried."""
    kind: Optional[str] = None
    """What class of failure, for records and counts: ``http_status``, ``timeout``,
    ``connection``, ``malformed``, ``too_large``, ``compressed`` (the call failed), or
    ``null`` / ``not_text`` (it completed without text: see :attr:`unreadable`)."""

    @property
    def ok(self) -> bool:
        return self.content is not None


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: Optional[float] = None, *, kind: str):
        super().__init__(reason)
        self.retry_after = retry_after
        self.kind = kind


class _Rejected(Exception):
    def __init__(self, message: str, status: Optional[int], *, kind: str = "http_status"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def _check_reply_head(response: Any) -> None:
    """An httpx response hook, run on the status line and headers before any of the body is
    read: refuse a compressed body, and one whose ``Content-Length`` is past the call's cap."""
    from mmtune.io.deadline import current_byte_cap

    encoding = response.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise _Rejected(f"the reply is compressed (Content-Encoding: {encoding[:40]}) although none was asked; "
                        "refused unread, since a compressed body can expand without bound", None, kind="compressed")
    cap = current_byte_cap()
    declared = response.headers.get("content-length", "")
    if cap is not None and declared.isdigit() and int(declared) > cap:
        raise _Rejected(f"the reply declares {int(declared)} bytes (Content-Length), larger than the cap of {cap} "
                        "bytes; refused unread", None, kind="too_large")


class ChatEndpoint:
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint with our retry loop and accounting.

    Args:
        settings: a settings dataclass with ``api_key_env``, ``base_url_env``, ``timeout_s``,
            ``max_retries``, ``backoff_base_s``, ``backoff_max_s`` and ``prices`` (the judge's
            and the api generation backend's both have them).
        env: environment mapping to read (``os.environ`` by default; tests pass a dict).
        role: the words and config section the messages use.
        stats: the counters to update (a caller's subclass of :class:`CallStats`).
        rng: jitter of the backoff waits (tests inject a seeded one).
    """

    def __init__(self, settings: Any, *, env: Any, role: Role = JUDGE, stats: Optional[CallStats] = None,
                 rng: Optional[random.Random] = None):
        import openai

        from mmtune.io.deadline import install_deadline
        from mmtune.io.secrets import Redactor, environment_secrets, redact_logging

        self.settings = settings
        self.role = role
        api_key, self.base_url, self.key_source, self.url_source = resolve_endpoint(settings, env)
        # The key in every spelling a message may carry it in (repr, JSON, URL-encoded, cut
        # short), and every other secret of the environment, e.g. echoed by a proxy's error page.
        self._redactor = Redactor([api_key] if api_key != "EMPTY" else [], min_chars=1)
        self._redactor.add(environment_secrets(env, [settings.api_key_env]))
        # The HTTP client logs every request's URL, credentials and all: every log handler
        # writes through the redactor while this endpoint is open.
        self._closing = contextlib.ExitStack()
        self._closing.enter_context(redact_logging(self._redactor))
        # max_retries=0: our loop below owns retries, so backoff and counting are in one place.
        # Connecting gets at most CONNECT_TIMEOUT_S: a host that drops packets would otherwise
        # hold every attempt for the whole timeout_s (7 x 120 s per call). timeout_s bounds the
        # whole attempt (connect to last byte), not each read: see mmtune/io/deadline.py.
        # openai.Timeout: the SDK's own HTTP package's type (httpx, or httpx2 from openai 3 on).
        timeout = openai.Timeout(settings.timeout_s, connect=min(CONNECT_TIMEOUT_S, settings.timeout_s))
        # identity: a compressed reply's size says nothing of what it expands to (see _check_reply_head)
        http_client = openai.DefaultHttpxClient(timeout=timeout, headers={"Accept-Encoding": "identity"},
                                                event_hooks={"response": [_check_reply_head]})
        install_deadline(http_client)
        self.client = openai.OpenAI(api_key=api_key, base_url=self.base_url, timeout=timeout, max_retries=0,
                                    http_client=http_client)
        self.stats = stats if stats is not None else CallStats()
        self.lock = threading.Lock()
        self._rng = rng or random.Random()

    @property
    def shown_url(self) -> str:
        """The base URL as every message and file shows it: credentials written in it as ``***``."""
        return self.redact(self.base_url or "https://api.openai.com/v1")

    def where(self) -> str:
        """``<url> (URL from <variable>; key from <variable>)``: never the key, nor the URL's credentials."""
        return f"{self.shown_url} (URL from {self.url_source}; key from {self.key_source})"

    def redact(self, text: str) -> str:
        """``text`` with the key (in any of its spellings) and the environment's secrets as ``***``."""
        return self._redactor.text(text)

    def price(self, model: str) -> tuple[float, float]:
        """USD per million (input, output) tokens of ``model``: the longest matching prefix of ``prices``."""
        best = ""
        for name in self.settings.prices:
            if model.startswith(name) and len(name) > len(best):
                best = name
        if not best:
            return 0.0, 0.0
        price = self.settings.prices[best]
        return float(price.get("input", 0.0)), float(price.get("output", 0.0))

    def _attempt(self, model: str, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                 extra: Optional[dict[str, Any]]) -> ChatReply:
        import openai
        from openai.types.chat import ChatCompletion

        from mmtune.io.deadline import ReplyTooLarge, byte_cap

        with self.lock:
            self.stats.calls += 1
        body = {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
                **(extra or {})}
        try:
            # The SDK's request path as ``chat.completions.create`` uses it, minus its per-field
            # transform of the body: on a long multi-turn, multi-image history that walk costs
            # more CPU than the call (the body here is plain JSON already).
            with deadline(self.settings.timeout_s), byte_cap(reply_cap(self.settings, max_tokens)):
                completion = self.client.post("/chat/completions", body=body, cast_to=ChatCompletion)
        except ReplyTooLarge as err:
            # Not retried: a server that sends this much for this request will do it again.
            raise _Rejected(f"{self.role.noun} reply larger than the cap of {err.limit} bytes for "
                            f"max_tokens={max_tokens}: cut off after {err.received} bytes (model {model!r})", None,
                            kind="too_large") from None
        except openai.RateLimitError as err:
            raise _Retryable("HTTP 429 rate limited", _retry_after(err), kind="http_status") from None
        except openai.InternalServerError as err:
            raise _Retryable(f"HTTP {err.status_code} server error", kind="http_status") from None
        except openai.APITimeoutError:
            raise _Retryable(f"timeout: no complete reply within {self.settings.timeout_s}s", kind="timeout") from None
        except openai.APIConnectionError as err:
            if _broke_http(err):
                # The server broke HTTP's framing (a Content-Length that lies, a runaway header
                # block): its reply is malformed, whichever read noticed it first.
                raise _Retryable(f"malformed reply: {_root_cause(err)}", kind="malformed") from None
            raise _Retryable(f"connection error: {_root_cause(err)}", kind="connection") from None
        except (openai.APIResponseValidationError, json.JSONDecodeError) as err:
            # Proxies and overloaded servers sometimes answer 200 with an HTML or truncated body.
            raise _Retryable(f"malformed reply: {type(err).__name__}", kind="malformed") from None
        except openai.APIStatusError as err:
            raise _Rejected(
                f"{self.role.noun} endpoint rejected the request with HTTP {err.status_code}: "
                f"{self.redact(str(err.message))[:300]} (model {model!r})", err.status_code) from None
        # A 200 with a body that is not a chat completion (proxies, broken servers) is retried.
        choices = getattr(completion, "choices", None)
        message = getattr(choices[0], "message", None) if isinstance(choices, list) and choices else None
        if message is None:
            raise _Retryable("malformed reply: no choices[0].message", kind="malformed")
        usage = getattr(completion, "usage", None)
        content = getattr(message, "content", None)
        unreadable = _unreadable(content)
        return ChatReply("" if unreadable else self.redact(content), unreadable=unreadable,
                         kind=None if unreadable is None else ("null" if content is None else "not_text"),
                         prompt_tokens=_count(getattr(usage, "prompt_tokens", 0)),
                         completion_tokens=_count(getattr(usage, "completion_tokens", 0)),
                         finish_reason=getattr(choices[0], "finish_reason", None))

    def fail(self, message: str, status: Optional[int], kind: Optional[str] = None) -> ChatReply:
        """Count a failed item (message redacted, cause diagnosed) and return its reply."""
        message = self.redact(message)
        cause = likely_cause(status, message, key_source=self.key_source, url_source=self.url_source, role=self.role)
        with self.lock:
            self.stats.failed += 1
            self.stats.causes[cause] = self.stats.causes.get(cause, 0) + 1
            if self.stats.first_error is None:
                self.stats.first_error = {"status": status, "message": message, "cause": cause}
        return ChatReply(None, error=message, status=status, cause=cause, kind=kind)

    def complete(self, model: str, messages: list[dict[str, Any]], *, temperature: float, max_tokens: int,
                 extra: Optional[dict[str, Any]] = None, sleep: Callable[[float], None] = time.sleep) -> ChatReply:
        """One chat completion with retries; never raises for a failed call (see :attr:`ChatReply.ok`).

        Args:
            extra: further request fields (``top_p``, ``seed``, a server's own such as vLLM's
                ``repetition_penalty``).
            sleep: waits between attempts (tests record them instead).
        """
        cfg = self.settings
        last, kind = "no attempt made", None
        for attempt in range(cfg.max_retries + 1):
            try:
                reply = self._attempt(model, messages, temperature=temperature, max_tokens=max_tokens, extra=extra)
            except _Retryable as err:
                last, kind = str(err), err.kind
                if attempt == cfg.max_retries:
                    break
                cap = min(cfg.backoff_max_s, cfg.backoff_base_s * (2**attempt))
                wait = self._rng.uniform(0, cap)
                if err.retry_after is not None:
                    wait = max(wait, min(err.retry_after, cfg.backoff_max_s))
                with self.lock:
                    self.stats.retries += 1
                log.debug("%s call failed (%s); retry %d in %.2fs", self.role.noun, last, attempt + 1, wait)
                sleep(wait)
                continue
            except _Rejected as err:
                return self.fail(str(err), err.status, err.kind)
            p_in, p_out = self.price(model)
            with self.lock:
                self.stats.completed += 1
                self.stats.prompt_tokens += reply.prompt_tokens
                self.stats.completion_tokens += reply.completion_tokens
                self.stats.cost_usd += (reply.prompt_tokens * p_in + reply.completion_tokens * p_out) / 1e6
            return reply
        match = re.search(r"HTTP (\d{3})", last)
        status = int(match.group(1)) if match else None
        message = f"{self.role.noun} call failed after {cfg.max_retries + 1} attempts; last error: {last}"
        log.warning(self.redact(message))
        return self.fail(message, status, kind)

    def check(self, model: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """Send one request of one token, so a wrong key, model name or URL stops the run
        now rather than after hours of work. Not counted in :attr:`stats`. A rate limit or a
        server error passes (the endpoint and key answered; the run's retries handle those).

        Raises:
            RuntimeError: naming what failed and its likely cause (callers wrap it in their own error).
        """
        import openai

        from mmtune.io.deadline import ReplyTooLarge, byte_cap

        url = self.shown_url
        wait = min(timeout_s, self.settings.timeout_s)
        try:
            with deadline(wait), byte_cap(reply_cap(self.settings, 1)):
                self.client.with_options(timeout=wait).chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Reply with the word OK."}],
                    max_tokens=1, temperature=0)
            return
        except ReplyTooLarge as err:
            status, message = None, (f"{self.role.noun} reply larger than the cap of {err.limit} bytes for "
                                     f"max_tokens=1: cut off after {err.received} bytes")
        except _Rejected as err:
            status, message = err.status, str(err)
        except (openai.RateLimitError, openai.InternalServerError) as err:
            log.warning("%s check: HTTP %s from %s; going on, calls will be retried", self.role.noun,
                        err.status_code, url)
            return
        except openai.APITimeoutError:
            status, message = None, f"timeout after {wait:g}s"
        except openai.APIConnectionError as err:
            status, message = None, f"connection error: {_root_cause(err)}"
        except openai.APIStatusError as err:
            status, message = err.status_code, f"HTTP {err.status_code}: {self.redact(str(err.message))[:300]}"
        cause = likely_cause(status, message, key_source=self.key_source, url_source=self.url_source, role=self.role)
        raise EndpointCheckFailed(f"the {self.role.noun} (model {model!r} at {url}) failed a one-token test request "
                                  f"before anything was generated: {message}. Likely cause: {cause}", status)

    def close(self) -> None:
        self.client.close()
        self._closing.close()


class EndpointCheckFailed(RuntimeError):
    """:meth:`ChatEndpoint.check` failed; ``status`` is the HTTP status (``None`` without one)."""

    def __init__(self, message: str, status: Optional[int]):
        super().__init__(message)
        self.status = status


def _count(value: Any) -> int:
    """A token count from a reply's ``usage``; anything that is not a count is 0."""
    try:
        return max(int(value or 0), 0)
    except (TypeError, ValueError, OverflowError):
        return 0


_JSON_TYPES = {dict: "object", list: "array", int: "number", float: "number", bool: "boolean"}


def _unreadable(content: Any) -> Optional[str]:
    """Why a reply's ``message.content`` is no text to parse, or None when it is a string."""
    if isinstance(content, str):
        return None
    if content is None:
        return "the reply's message content is null (no text: a refusal or a tool call?)"
    shown = json.dumps(content, default=str)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"the reply's message content is a JSON {_JSON_TYPES.get(type(content), type(content).__name__)} ({shown}), not text"


def _retry_after(err: Any) -> Optional[float]:
    response = getattr(err, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _broke_http(err: BaseException) -> bool:
    """Whether a connection error's chain holds h11's ``RemoteProtocolError``: the peer's bytes
    broke HTTP/1.1 (a body longer or shorter than its Content-Length, a header block past h11's
    limit), as opposed to a refused, reset or silently dropped connection."""
    import h11

    return any(isinstance(cause, h11.RemoteProtocolError) for cause in _causes(err))


def _causes(err: BaseException) -> Iterator[BaseException]:
    """``err``, then what caused it (``__cause__``, else ``__context__``), down to the innermost."""
    seen: Optional[BaseException] = err
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _root_cause(err: BaseException) -> str:
    """The innermost exception's text (``[Errno 111] Connection refused``) of a connection error."""
    *_, seen = _causes(err)
    text = str(seen) or type(seen).__name__
    return text if seen is err else f"{type(seen).__name__}: {text}"


# ---------------------------------------------------------------------------- images


class ImageRefused(ValueError):
    """An image that is not sent (see the subclasses)."""


class ImageTooLarge(ImageRefused):
    """An image above the size cap, with the cap's policy ``refuse``."""


class ImageOutsideRoot(ImageRefused):
    """An image file that, when opened, lies outside its image root (or is no regular file)."""


def open_image(path: str, root: Optional[str]) -> bytes:
    """The bytes of the image file ``path``, read from one open that is checked to lie inside
    ``root`` (:func:`mmtune.io.confined.read_inside`; ``None``: not confined).

    Raises:
        ImageOutsideRoot: the file opened is outside ``root``, or not a regular file.
    """
    from mmtune.io.confined import OutsideRoot, read_inside

    try:
        return read_inside(path, root)
    except OutsideRoot as err:
        raise ImageOutsideRoot(str(err)) from None


def image_upload(path: str, *, setting: str, receiver: str, remedy: str,
                 root: Optional[str] = None, data: Optional[bytes] = None) -> tuple[str, bytes]:
    """``(mime type, bytes)`` of an image file, as it is on disk when read.

    The file is opened once, inside ``root`` (:func:`open_image`), and what is checked is
    what is sent: its bytes must decode as an image header (PIL) whatever its name says, so
    only image files ever leave the machine, never a file an image path happens to point at.

    Args:
        setting, receiver, remedy: for the message (``judge.send_images``, ``the judge``,
            what to change).
        root: the image root the file must lie in when opened (``Image.root``).
        data: the file's bytes, already read by :func:`open_image` (then not read again).

    Raises:
        ImageOutsideRoot: see :func:`open_image`.
        ValueError: the file is not an image.
    """
    from PIL import Image as PILImage

    raw = open_image(path, root) if data is None else data
    try:
        with PILImage.open(io.BytesIO(raw)) as image:
            kind = image.format
    except Exception as err:  # PIL raises many types for files that are not images
        raise ValueError(
            f"{setting}: {path} is not an image file ({type(err).__name__}: {err}); only image files are "
            f"sent to {receiver}. {remedy}"
        ) from None
    mime = PILImage.MIME.get(kind or "", mimetypes.guess_type(path)[0] or "image/png")
    return mime, raw


def image_data_url(path: str, *, max_side: Optional[int], max_bytes: Optional[int], oversize: str,
                   setting: str, receiver: str, remedy: str, root: Optional[str] = None,
                   data: Optional[bytes] = None) -> tuple[str, Optional[str]]:
    """``(data URL, what was done)`` of an image file for a chat message.

    An image within the caps goes as the file's own bytes. One whose longer side exceeds
    ``max_side`` pixels, or whose file exceeds ``max_bytes``, is downscaled to fit
    (``oversize="downscale"``: aspect ratio kept, Lanczos, re-encoded as PNG, as JPEG at
    quality 90 when the PNG is still above ``max_bytes``) or refused (``"refuse"``).

    Returns:
        The ``data:<mime>;base64,...`` URL and ``None``, or a note such as
        ``"downscaled 4000x3000 -> 2048x1536"``.

    Raises:
        ImageTooLarge: above a cap with ``oversize="refuse"``, or still above
            ``max_bytes`` after downscaling.
        ImageOutsideRoot: the file opened lies outside ``root`` (:func:`open_image`).
        ValueError: the file is not an image.
    """
    from PIL import Image as PILImage

    mime, raw = image_upload(path, setting=setting, receiver=receiver, remedy=remedy, root=root, data=data)
    with PILImage.open(io.BytesIO(raw)) as image:
        size = image.size
        too_wide = max_side is not None and max(size) > max_side
        too_big = max_bytes is not None and len(raw) > max_bytes
        if not (too_wide or too_big):
            return _data_url(mime, raw), None
        what = (f"{size[0]}x{size[1]} px (cap {max_side} px a side)" if too_wide
                else f"{len(raw) / 1e6:.1f} MB (cap {max_bytes / 1e6:.1f} MB)")
        if oversize != "downscale":
            raise ImageTooLarge(f"{path} is {what}: refused ({setting.rsplit('.', 1)[0]}.oversize=refuse); "
                                "use oversize=downscale or a smaller image")
        scale = min(1.0, max_side / max(size)) if max_side is not None else 1.0
        rgb = image.convert("RGB")
    for fmt, mime_out in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        current = scale
        for _ in range(8):  # each round shrinks the byte count; 8 rounds reach 10% of the area
            target = (max(1, round(size[0] * current)), max(1, round(size[1] * current)))
            resized = rgb.resize(target, PILImage.LANCZOS) if target != size else rgb
            buffer = io.BytesIO()
            resized.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            data = buffer.getvalue()
            if max_bytes is None or len(data) <= max_bytes:
                return _data_url(mime_out, data), f"downscaled {size[0]}x{size[1]} -> {target[0]}x{target[1]} {fmt}"
            if fmt == "PNG":
                break  # try JPEG at this size before shrinking further
            current *= 0.75
    raise ImageTooLarge(f"{path} is {what} and stays above {max_bytes / 1e6:.1f} MB after downscaling; "
                        "use a smaller image or raise the cap")


def _data_url(mime: str, raw: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode('ascii')}"

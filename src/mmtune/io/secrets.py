"""Secrets: which config keys hold one, where their values come from, one redaction for every writer.

A secret reaches mmtune two ways. As a config value under a key that names one
(``judge.api_key``, ``hub_token``: :func:`is_secret_key`), and as the value of an
environment variable (the judge's API key, ``HF_TOKEN``, ``WANDB_API_KEY``), which a
config can pull in anywhere through an interpolation
(``run_name: run-${oc.env:MMTUNE_JUDGE_API_KEY}``). Every file, log line, console
message and W&B record mmtune writes from configs or from a judge passes through
:class:`Redactor` (or :func:`redact`, built from the environment), which replaces

- the value of every secret key with ``***``;
- every occurrence of a known secret value inside any string, also in the forms a
  message may carry it in: Python ``repr`` escapes and bytes reprs
  (``b'Bearer sk-...'``), JSON string escapes (once and twice), URL encoding, and a
  secret cut short at the end of a truncated message (``sk-ab...``);
- the credentials of every URL written with them (``http://user:pass@host/v1`` becomes
  ``http://***@host/v1``), known or not: a base URL may carry a proxy's password, and the
  HTTP client logs each request's URL.

A URL with credentials in any environment variable (``MMTUNE_GEN_BASE_URL``) makes its
password, its ``user:password`` and their HTTP Basic encoding secret values too, so they
are hidden wherever else they appear. :func:`redact_logging` puts the same redaction in
front of every log handler (the console, Hydra's log file), for records of any library.

Secret values are the values of environment variables whose names are secret keys
(``MMTUNE_JUDGE_API_KEY``, ``OPENAI_API_KEY``, ``HF_TOKEN``) or are named explicitly
(``judge.api_key_env`` may name any variable), with surrounding whitespace stripped.
Values shorter than :data:`MIN_SECRET_CHARS` are not searched for: a local server's
placeholder key (``EMPTY``) is no secret, and replacing a short string everywhere would
garble text. :func:`clean_secret` is how a key is read at start-up: a trailing ``\\r``
or ``\\n`` (a pasted key, a key read from a file) is stripped, and whitespace inside a
key is refused naming the variable, never the value.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import re
from typing import Any, Iterable, Iterator, Mapping, Optional
from urllib.parse import quote, quote_plus, unquote, urlsplit

__all__ = ["MASK", "MIN_SECRET_CHARS", "SecretError", "is_secret_key", "clean_secret", "environment_secrets",
           "url_credentials", "Redactor", "RedactingFilter", "redact", "redact_text", "redact_logging"]

MASK = "***"
MIN_SECRET_CHARS = 8
"""Secret values shorter than this are not searched for in texts (see the module docstring)."""
_MIN_PREFIX = 6
"""A truncated secret is recognised from this many of its first characters on."""

# A key names a secret *value* when its last word is one of these ...
_SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "apikey", "credential", "credentials"})
# ... or it ends in "key"/"token" after a word that makes it a credential ("api_key",
# "hub_token"); "cache_key", "pad_token" or "image_token" are not. Keys that name where a
# secret lives ("api_key_env", "token_file") end in another word and are kept.
_CREDENTIAL_QUALIFIERS = frozenset({
    "api", "access", "auth", "bearer", "client", "hf", "hub", "huggingface", "openai", "anthropic", "azure",
    "wandb", "github", "gh", "private", "secret", "session", "refresh", "service", "signing", "encryption",
    "license", "account", "subscription", "personal", "oauth", "id", "judge",
})
_TRUNCATION = re.compile(r"\.\.\.|\u2026")
# scheme://userinfo@ : the userinfo ends at the last "@" before the host (a password may hold "@")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/\s?#'\"<>`]*@")


class SecretError(ValueError):
    """A secret's environment variable holds something that cannot be a key."""


def is_secret_key(name: Any) -> bool:
    """Whether a config key holds a secret value (an API key, token or password).

    Only the key's last words count: ``api_key``, ``hub_token``, ``db_password`` and
    ``client_secret`` do; ``api_key_env`` (the *name* of an environment variable),
    ``cache_key``, ``max_tokens``, ``pad_token`` and ``tokenizer`` do not.
    """
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower()) if w]
    if not words:
        return False
    last = words[-1]
    if last in _SECRET_WORDS:
        return True
    if last in ("key", "token"):
        return len(words) == 1 and last == "token" or (len(words) > 1 and words[-2] in _CREDENTIAL_QUALIFIERS)
    return False


def clean_secret(value: str, variable: str) -> str:
    """``value`` of the environment variable ``variable`` without surrounding whitespace.

    A key copied from a web page or read from a file often ends in ``\\r`` or ``\\n``; sent
    as is, it breaks the HTTP header and the client's error prints the header, key and all.

    Raises:
        SecretError: whitespace or a control character inside the value (the message names
            the variable and what was found, never the value).
    """
    stripped = value.strip()
    bad = next((c for c in stripped if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise SecretError(
            f"${variable} holds {_describe(bad)} inside its value; an API key has none. Set the variable to the "
            "key alone (e.g. `export " + variable + "=\"$(tr -d '[:space:]' < keyfile)\"`)"
        )
    return stripped


def _describe(char: str) -> str:
    names = {" ": "a space", "\t": "a tab", "\n": "a line break (\\n)", "\r": "a carriage return (\\r)"}
    return names.get(char, f"the character U+{ord(char):04X}")


def url_credentials(value: str) -> list[str]:
    """The secret parts of a URL written with credentials (``scheme://user:pass@host``): the
    userinfo as written, the password (as written and decoded) and the HTTP Basic
    credentials the client sends for them; ``[]`` for anything else."""
    if "://" not in value or "@" not in value:
        return []
    try:
        parts = urlsplit(value.strip())
    except ValueError:
        return []
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    if not userinfo:
        return []
    user, _, password = userinfo.partition(":")
    basic = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode("utf-8")).decode("ascii")
    return [v for v in {userinfo, password, unquote(password), basic} if v]


def environment_secrets(env: Optional[Mapping[str, str]] = None, names: Iterable[str] = ()) -> list[str]:
    """Secret values of the environment: the variables whose names are secret keys, and
    ``names``; and the credentials of any variable's URL (:func:`url_credentials`).

    Values are stripped; values shorter than :data:`MIN_SECRET_CHARS` are left out.
    """
    env = os.environ if env is None else env
    wanted = set(names)
    values = []
    for name, value in env.items():
        if not isinstance(value, str):
            continue
        found = [value.strip()] if name in wanted or is_secret_key(name) else []
        found += url_credentials(value)
        values += [v for v in found if len(v) >= MIN_SECRET_CHARS]
    return values


def _forms(secret: str) -> set[str]:
    """The ways ``secret`` can be spelled inside a message."""
    once = json.dumps(secret)[1:-1]
    forms = {
        secret,
        repr(secret)[1:-1],  # str repr: "\r" written as backslash-r
        repr(secret.encode("utf-8"))[2:-1],  # bytes repr: b'...'
        once,  # JSON string
        json.dumps(once)[1:-1],  # JSON of a JSON string (an error body quoted in a log record)
        quote(secret, safe=""),
        quote_plus(secret, safe=""),
    }
    return {f for f in forms if f}


class Redactor:
    """Replaces secret values (and the values of secret keys) by ``***``.

    Args:
        secrets: the secret values to hide (each stripped).
        min_chars: shorter values are ignored (see :data:`MIN_SECRET_CHARS`); a caller that
            knows a value is a key (the judge's own) passes 1.
    """

    def __init__(self, secrets: Iterable[Optional[str]] = (), *, min_chars: int = MIN_SECRET_CHARS):
        self._forms: list[str] = []
        self._pattern: Optional[re.Pattern[str]] = None
        self.add(secrets, min_chars=min_chars)

    def add(self, secrets: Iterable[Optional[str]], *, min_chars: int = MIN_SECRET_CHARS) -> None:
        """Hide these values too."""
        forms = set(self._forms)
        for secret in secrets:
            if isinstance(secret, str) and len(secret.strip()) >= max(1, min_chars):
                forms |= _forms(secret.strip())
        self._forms = sorted(forms, key=len, reverse=True)  # longest first: a form may contain another
        self._pattern = re.compile("|".join(map(re.escape, self._forms))) if self._forms else None

    def __bool__(self) -> bool:
        return self._pattern is not None

    def text(self, text: str) -> str:
        """``text`` with every secret (whole, or cut short before ``...`` or the end) and the
        credentials of every URL replaced."""
        if not isinstance(text, str) or not text:
            return text
        if "://" in text:
            text = _URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
        if self._pattern is None:
            return text
        text = self._pattern.sub(MASK, text)
        return self._truncated(text)

    def _truncated(self, text: str) -> str:
        """Hide a secret's first characters where a message was cut: before ``...`` or at the end."""
        ends = {len(text)} | {m.start() for m in _TRUNCATION.finditer(text)}
        for end in sorted(ends, reverse=True):
            for form in self._forms:
                for size in range(min(len(form) - 1, end), _MIN_PREFIX - 1, -1):
                    if text.startswith(form[:size], end - size):
                        text = text[: end - size] + MASK + text[end:]
                        break
                else:
                    continue
                break
        return text

    def value(self, value: Any) -> Any:
        """A copy of nested dicts / lists / tuples / strings with every secret hidden: the
        values of secret keys (:func:`is_secret_key`; non-empty strings only, so counts such as
        ``max_tokens`` stay) and secret values inside any string (keys included)."""
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k:
                    (MASK if is_secret_key(k) and isinstance(v, str) and v else self.value(v))
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        if isinstance(value, str):
            return self.text(value)
        return value


class RedactingFilter(logging.Filter):
    """A log filter that rewrites each record's message (and its traceback) through a :class:`Redactor`."""

    def __init__(self, redactor: "Redactor"):
        super().__init__()
        self.redactor = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is left to the handler
            return True
        record.msg, record.args = self.redactor.text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redactor.text(record.exc_text)
        return True


@contextlib.contextmanager
def redact_logging(redactor: "Redactor") -> Iterator[RedactingFilter]:
    """Within the block, every handler of the root logger (the console, Hydra's log file)
    writes records only through ``redactor``: a library logging a URL with credentials or a
    key (the HTTP client logs each request's URL) writes ``***`` in their place."""
    shown = RedactingFilter(redactor)
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(shown)
    try:
        yield shown
    finally:
        for handler in handlers:
            handler.removeFilter(shown)


def redact(value: Any, *, names: Iterable[str] = (), env: Optional[Mapping[str, str]] = None) -> Any:
    """:meth:`Redactor.value` with the secrets of the environment (:func:`environment_secrets`).

    Args:
        names: environment variables that hold secrets whatever their names (``judge.api_key_env``).
        env: the environment to read (default ``os.environ``).
    """
    return Redactor(environment_secrets(env, names)).value(value)


def redact_text(text: str, *, names: Iterable[str] = (), env: Optional[Mapping[str, str]] = None) -> str:
    """:meth:`Redactor.text` with the secrets of the environment."""
    return Redactor(environment_secrets(env, names)).text(text)

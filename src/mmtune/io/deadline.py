"""A wall-clock deadline and a byte cap for a whole HTTP call, which httpx's timeouts are not.

httpx (and so the openai SDK) applies ``timeout`` to each network operation: connecting,
each write, each read. A server that sends one byte every half second never lets a read
time out, so a call with ``timeout=2`` can last as long as the server likes (44 s in a
test with a trickling loopback server). :func:`install_deadline` wraps the network layer
of an httpx client so that every connect, TLS handshake, write and read of a call made
inside :func:`deadline` waits at most until the call's deadline: the call then fails
with httpx's own ``ReadTimeout`` (the SDK's ``APITimeoutError``), which the judge retries
like any timeout.

The same wrapper counts the bytes a call receives inside :func:`byte_cap`: status line,
headers and body (an error body too), as they come off the connection, in reads of at most
what is left. Past the cap the read raises :class:`ReplyTooLarge` and the connection is
dropped, so a server answering a 32-token request with 50 MB, or with a body that never
ends, costs the client the cap's bytes of memory, not the body's (the time limit alone
would let an endless body grow for the whole ``timeout_s``).

The deadline and the cap are per thread (the judge's worker threads each make one
synchronous call at a time), so connections shared by the pool obey the limits of the
call using them.
The openai SDK ships with httpx or its successor httpx2 (httpcore / httpcore2 beneath);
the wrapper raises the timeouts of whichever package the client's pool comes from.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
import warnings
from typing import Any, Iterator, Optional

__all__ = ["deadline", "byte_cap", "ByteBudget", "ReplyTooLarge", "current_byte_cap", "install_deadline"]

_LOCAL = threading.local()


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Network operations of this thread inside the block end at most ``seconds`` from now."""
    previous = getattr(_LOCAL, "at", None)
    _LOCAL.at = time.monotonic() + seconds
    try:
        yield
    finally:
        _LOCAL.at = previous


class ReplyTooLarge(Exception):
    """A call received more bytes than its :func:`byte_cap` allows."""

    def __init__(self, limit: int, received: int):
        super().__init__(f"more than {limit} bytes received, the cap")
        self.limit, self.received = limit, received


class ByteBudget:
    """What one call inside :func:`byte_cap` may still receive, and what it did."""

    def __init__(self, limit: int):
        self.limit = limit
        self.received = 0
        """Bytes read from the connection so far (at most ``limit + 1``)."""


@contextlib.contextmanager
def byte_cap(limit: int) -> Iterator[ByteBudget]:
    """Network reads of this thread inside the block receive at most ``limit`` bytes in all;
    one more raises :class:`ReplyTooLarge`."""
    previous = getattr(_LOCAL, "budget", None)
    budget = _LOCAL.budget = ByteBudget(int(limit))
    try:
        yield budget
    finally:
        _LOCAL.budget = previous


def current_byte_cap() -> Optional[int]:
    """The byte cap of this thread's call, or None outside :func:`byte_cap`."""
    budget = getattr(_LOCAL, "budget", None)
    return None if budget is None else budget.limit


def _remaining(timeout: Optional[float], error: type) -> Optional[float]:
    """``timeout`` shortened to what is left of this thread's deadline (raises ``error`` when none is)."""
    at = getattr(_LOCAL, "at", None)
    if at is None:
        return timeout
    left = at - time.monotonic()
    if left <= 0:
        raise error("the call's deadline passed before its reply was complete")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream:
    """A network stream whose every operation is bounded by the calling thread's deadline.

    ``core`` is the httpcore package of the pool (its timeout exceptions are raised)."""

    def __init__(self, inner: Any, core: Any):
        self._inner, self._core = inner, core

    def read(self, max_bytes: int, timeout: Optional[float] = None) -> bytes:
        budget: Optional[ByteBudget] = getattr(_LOCAL, "budget", None)
        if budget is None:
            return self._inner.read(max_bytes, _remaining(timeout, self._core.ReadTimeout))
        # one byte past the cap is enough to know the reply is too large
        wanted = max(1, min(max_bytes, budget.limit - budget.received + 1))
        data = self._inner.read(wanted, _remaining(timeout, self._core.ReadTimeout))
        budget.received += len(data)
        if budget.received > budget.limit:
            raise ReplyTooLarge(budget.limit, budget.received)
        return data

    def write(self, buffer: bytes, timeout: Optional[float] = None) -> None:
        self._inner.write(buffer, _remaining(timeout, self._core.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: Optional[str] = None,
                  timeout: Optional[float] = None) -> "_DeadlineStream":
        stream = self._inner.start_tls(ssl_context, server_hostname, _remaining(timeout, self._core.ConnectTimeout))
        return _DeadlineStream(stream, self._core)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend:
    """An httpcore network backend whose connections are :class:`_DeadlineStream` s."""

    def __init__(self, inner: Any, core: Any):
        self._inner, self._core = inner, core

    def connect_tcp(self, host: str, port: int, timeout: Optional[float] = None, local_address: Optional[str] = None,
                    socket_options: Any = None) -> _DeadlineStream:
        stream = self._inner.connect_tcp(host, port, _remaining(timeout, self._core.ConnectTimeout), local_address,
                                         socket_options)
        return _DeadlineStream(stream, self._core)

    def connect_unix_socket(self, path: str, timeout: Optional[float] = None,
                            socket_options: Any = None) -> _DeadlineStream:
        stream = self._inner.connect_unix_socket(path, _remaining(timeout, self._core.ConnectTimeout), socket_options)
        return _DeadlineStream(stream, self._core)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def install_deadline(client: Any) -> bool:
    """Make every transport of the httpx ``client`` (direct and proxied) obey :func:`deadline` and :func:`byte_cap`.

    httpx has no public hook for httpcore's network backend, so this wraps the backend
    each transport's connection pool holds. Returns False, after a warning, when a
    transport is laid out differently (another httpx version): its calls then have
    per-operation timeouts only.
    """
    transports = [getattr(client, "_transport", None), *getattr(client, "_mounts", {}).values()]
    installed = True
    for transport in transports:
        if transport is None:
            continue
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if isinstance(backend, _DeadlineBackend):
            continue
        core = _package_of(pool)
        if core is None or backend is None or not hasattr(core, "ReadTimeout"):
            installed = False
            continue
        pool._network_backend = _DeadlineBackend(backend, core)
    if not installed:
        warnings.warn("this httpx version's transports cannot take a deadline or a byte cap: judge.timeout_s bounds "
                      "each network read, not the whole call, and a reply's size is bounded only by the Content-Length "
                      "check", RuntimeWarning, stacklevel=2)
    return installed


def _package_of(pool: Any) -> Any:
    """The httpcore package (``httpcore``, ``httpcore2``) a connection pool belongs to, or None."""
    if pool is None:
        return None
    try:
        core = importlib.import_module(type(pool).__module__.partition(".")[0])
    except ImportError:
        return None
    return core if isinstance(pool, getattr(core, "ConnectionPool", ())) else None

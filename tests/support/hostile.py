"""Replies of a hostile or broken model server, as :class:`~tests.support.fake_judge.Scripted`
values: bodies far larger than the request allows (declared, chunked, delimited by the
connection's close, with a Content-Length that lies), bodies that never end, error bodies
of the same kinds, headers that never end, compressed bodies, and completions whose content is null, an object or
empty. Each streamed body is bounded by the server (``STREAM_LIMIT``)."""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

from tests.support.fake_judge import Scripted

__all__ = ["completion", "huge_completion", "endless", "OVERSIZED", "EMPTY_OR_NOT_TEXT"]

MB = 1_000_000


def completion(content: Any, finish_reason: str = "stop") -> bytes:
    """A chat completion body whose message content is ``content`` (any JSON value)."""
    return json.dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                       "choices": [{"index": 0, "finish_reason": finish_reason,
                                    "message": {"role": "assistant", "content": content}}],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}).encode()


def huge_completion(size: int) -> tuple[Callable[[], Iterator[bytes]], int]:
    """A valid chat completion whose answer is ``size`` bytes: (body chunks, total length)."""
    head, tail = completion("@@").split(b"@@")

    def chunks() -> Iterator[bytes]:
        yield head
        left = size
        while left > 0:
            n = min(left, 65536)
            yield b"a" * n
            left -= n
        yield tail
    return chunks, len(head) + size + len(tail)


def endless() -> Iterator[bytes]:
    while True:
        yield b"a" * 65536


_BIG, _BIG_LEN = huge_completion(50 * MB)

OVERSIZED = {
    "50MB_declared": lambda: Scripted(stream=_BIG, framing="length", declared=_BIG_LEN),
    "50MB_chunked": lambda: Scripted(stream=_BIG, framing="chunked"),
    "50MB_until_close": lambda: Scripted(stream=_BIG, framing="close"),
    "endless_chunked": lambda: Scripted(stream=endless, framing="chunked"),
    "endless_until_close": lambda: Scripted(stream=endless, framing="close"),
    "length_that_lies": lambda: Scripted(stream=endless, framing="length", declared=2000),
    "error_500_endless": lambda: Scripted(status=500, stream=endless, framing="chunked"),
    "error_400_50MB": lambda: Scripted(status=400, stream=_BIG, framing="length", declared=_BIG_LEN),
    "endless_headers": lambda: Scripted(stream=endless, framing="headers"),
    "gzip_body": lambda: Scripted(stream=_BIG, framing="chunked", headers={"Content-Encoding": "gzip"}),
}
"""Name -> a reply no 32-token request may cost more than its cap for."""

EMPTY_OR_NOT_TEXT = {
    "null": (lambda: Scripted(raw=completion(None)), "null"),
    "object": (lambda: Scripted(raw=completion({"text": "hi"})), "not_text"),
    "number": (lambda: Scripted(raw=completion(7)), "not_text"),
    "empty": (lambda: Scripted(""), "empty"),
    "blank": (lambda: Scripted(" \n\t"), "empty"),
}
"""Name -> (a completed reply without a usable answer, the ``kind`` its record must say)."""

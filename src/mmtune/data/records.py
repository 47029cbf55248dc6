"""Records of a JSON list or JSONL file, read as a stream: :func:`iter_records`.

Any format may be stored as a JSON list or as JSONL; the first non-blank character
decides. A JSON list is read incrementally (:func:`iter_json_array`), so a 1.3 GB file is
never held in memory whole. One bad record (bytes that are not UTF-8, broken JSON inside
its own brackets, nesting deeper than the parser follows, an escape such as ``\\ud800``
that is no character) is yielded with its :class:`~mmtune.data.validation.Problem`; the
records after it are read as usual.
"""

from __future__ import annotations

import json
import re
from typing import Any, BinaryIO, Callable, Iterator, TextIO

from mmtune.data.validation import DataValidationError, Problem

__all__ = ["MAX_RECORD_BYTES", "iter_json_array", "iter_jsonl", "iter_records", "surrogate_problem"]

_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE = re.compile("[\udc80-\udcff]")
#: the default bound on one record's size (``data.validation.max_record_bytes``): 256 MiB
MAX_RECORD_BYTES = 256 * 1024 * 1024
# an over-long JSONL line is skipped in reads of this many bytes, never held whole
_SKIP_CHUNK = 1 << 20
# A ``\\uD800``-``\\uDFFF`` escape in the raw text; only a record holding one can decode to
# a lone surrogate (a valid pair decodes to one character), so only those are walked.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Tokens that decide where a JSON value ends: whole strings (JSON forbids raw line breaks
# in them, so a string never spans a line), a quote that opens no complete string, and
# brackets. Everything between them is skipped.
_STRING = r'"[^"\\\n\r]*(?:\\.[^"\\\n\r]*)*"'
_EXTENT_TOKEN = re.compile(_STRING + r'|["\[\]{}]')
_OPEN_STRING = re.compile(r'"[^"\\\n\r]*(?:\\.[^"\\\n\r]*)*\\?\Z')
_ID_VALUE = re.compile(r'[ \t\n\r]*:[ \t\n\r]*(' + _STRING + r'|-?\d+)')
_OPENER = {"]": "[", "}": "{"}


def _printable(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes, bad escapes) spelled as ``\\udcxx``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """``(where, escape)`` of the first lone UTF-16 surrogate in a parsed record's strings or
    keys (``("conversations[2].value", "\\ud800")``), or ``None``. Iterative: records may
    nest deeply."""
    todo: list[tuple[str, Any]] = [("", value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            found = _LONE_SURROGATE.search(v)
            if found:
                return where or "the record", f"\\u{ord(found.group()):04x}"
        elif isinstance(v, dict):
            for k in v:
                found = _LONE_SURROGATE.search(k)
                if found:
                    return f"key '{_printable(k)}'" + (f" of {where}" if where else ""), f"\\u{ord(found.group()):04x}"
            todo.extend((f"{where}.{k}" if where else str(k), x) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            todo.extend((f"{where}[{i}]", v[i]) for i in reversed(range(len(v))))
    return None


def _surrogate_problem(value: Any, index: int, rid: str) -> Problem | None:
    """A ``lone_surrogate`` problem naming the field (and turn) that holds one, or ``None``."""
    found = _lone_surrogate(value)
    if found is None:
        return None
    where, escape = found
    turn = re.match(r"(?:conversations|messages)\[(\d+)\]", where)
    return Problem("lone_surrogate", rid, index, int(turn.group(1)) if turn else None,
                   f"{where} holds {escape} without the other half of its pair")


def surrogate_problem(value: Any, index: int, record_id: str) -> Problem | None:
    """A ``lone_surrogate`` problem of a parsed record (naming the field that holds one), or ``None``.

    For readers of other layouts (a JSON object keyed by item id) that parse a file
    themselves; :func:`iter_records` checks its records already.
    """
    return _surrogate_problem(value, index, record_id)


def _value_id(value: Any, default: str) -> str:
    rid = value.get("id") if isinstance(value, dict) else None
    return _printable(str(rid)) if rid is not None and rid != "" else default


def _element_extent(text: str, pos: int) -> tuple[str, int, str | None]:
    """Where the JSON object or array starting at ``text[pos]`` ends, found without parsing it.

    Used when the parser cannot take an element (it nests too deeply, or its syntax is
    broken) so that only that element is skipped. Brackets must pair by type and strings
    must close on their line, so a stray quote or bracket does not resynchronise
    somewhere arbitrary: it is reported as ``broken``.

    Returns:
        ``(status, end, record_id)``: status ``complete`` (``end`` is just past the
        element), ``more`` (the text ends inside it) or ``broken`` (no safe end;
        ``end`` is where that was found); the element's top-level ``id`` if seen.
    """
    if pos >= len(text) or text[pos] not in "[{":
        return "broken", pos, None
    stack: list[str] = []
    rid = None
    for m in _EXTENT_TOKEN.finditer(text, pos):
        token = m.group()
        if token[0] == '"':
            if len(token) == 1:  # a quote that opens no complete string
                return ("more" if _OPEN_STRING.match(text, m.start()) else "broken"), m.start(), rid
            if rid is None and token == '"id"' and stack == ["{"]:
                found = _ID_VALUE.match(text, m.end())
                if found:
                    try:
                        rid = _printable(str(json.loads(found.group(1))))
                    except ValueError:
                        rid = _printable(found.group(1))
        elif token in "[{":
            stack.append(token)
        elif not stack or stack.pop() != _OPENER[token]:
            return "broken", m.start(), rid
        elif not stack:
            return "complete", m.end(), rid
    return "more", len(text), rid


class _ArrayText:
    """The unparsed tail ``buf[pos:]`` of a JSON list file read in chunks, with what is
    needed to name a spot in it (``line N, column M``) and to read on when an element
    crosses the chunk's end.

    ``dirty`` / ``escaped`` say whether the buffer may hold undecodable bytes / a
    ``\\uD800``-style escape: searching every record for them costs more than parsing
    it, while searching each chunk once and records only in such a buffer costs almost
    nothing.
    """

    def __init__(self, f: TextIO, path: str, chunk_chars: int, max_record_bytes: int) -> None:
        self.f, self.path = f, path
        self.chunk_chars, self.max_record_bytes = chunk_chars, max_record_bytes
        self.buf, self.pos, self.eof, self.lines_before = f.read(chunk_chars), 0, False, 0
        self.dirty = _SURROGATE.search(self.buf) is not None
        self.escaped = _SURROGATE_ESCAPE.search(self.buf) is not None

    def refill(self) -> bool:
        """Append the next chunk to the unparsed tail (``pos`` becomes 0); ``False`` at the end."""
        if self.eof:
            return False
        more = self.f.read(self.chunk_chars)
        if not more:
            self.eof = True
            return False
        buf, pos = self.buf, self.pos
        self.lines_before += buf.count("\n", 0, pos)
        self.dirty = _SURROGATE.search(buf, pos) is not None or _SURROGATE.search(more) is not None
        self.buf, self.pos = buf[pos:] + more, 0
        # searched again whole: an escape may straddle the old chunk's end
        self.escaped = _SURROGATE_ESCAPE.search(self.buf) is not None
        return True

    def skip_ws(self) -> None:
        """Move ``pos`` past white space, reading on until something else or the end."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf) or not self.refill():
                return

    def where(self, at: int) -> str:
        """``line N, column M`` of ``buf[at]`` in the file."""
        line = self.lines_before + self.buf.count("\n", 0, at) + 1
        col = at - (self.buf.rfind("\n", 0, at) + 1) + 1
        return f"line {line}, column {col}"

    def fail(self, at: int, what: str, index: int) -> DataValidationError:
        """The error for a break in the list's own structure at ``buf[at]``."""
        return DataValidationError(
            f"{self.path}: invalid JSON at {self.where(at)} (array element #{index}): {what}. "
            "How to fix: repair the file (e.g. `python -m json.tool FILE` shows the spot). A break in the "
            "list's own structure leaves no safe way to tell where the next record starts, so it fails the "
            "whole file; a record broken inside its own brackets is skipped alone."
        )

    def extent(self, index: int) -> tuple[int, str | None]:
        """End and id of the element at ``pos``, reading on as needed; fatal when none is safe."""
        while True:
            status, end, rid = _element_extent(self.buf, self.pos)
            if status == "complete":
                return end, rid
            if status == "more" and len(self.buf) - self.pos <= self.max_record_bytes and self.refill():
                continue
            raise self.fail(end, "an element nested too deeply to parse, whose end cannot be found"
                            if status == "broken" else "file ends inside a deeply nested element", index)


def _open_list(text: _ArrayText) -> bool:
    """Move past the BOM, white space and the list's ``[``; ``False`` when the list is empty.

    Raises:
        DataValidationError: the file does not start with ``[``.
    """
    if text.buf.startswith("\ufeff"):
        text.pos = 1
    text.skip_ws()
    if text.pos >= len(text.buf) or text.buf[text.pos] != "[":
        raise text.fail(text.pos, "expected '[' at the start of a JSON list", 0)
    text.pos += 1
    text.skip_ws()
    return not (text.pos < len(text.buf) and text.buf[text.pos] == "]")


def _decode_element(text: _ArrayText, decoder: json.JSONDecoder, index: int) -> tuple[Any, int, Problem | None]:
    """``(value, end, problem)`` of the element at ``text.pos``, reading on while it is cut by
    the chunk's end; ``end`` is just past it in ``text.buf``. An element too deep to parse,
    or broken inside its own brackets, is ``(None, end, problem)``.

    Raises:
        DataValidationError: the element's end cannot be found safely.
    """
    while True:
        try:
            value, end = decoder.raw_decode(text.buf, text.pos)
            # A number ending exactly at the chunk end may continue in the next one.
            if end < len(text.buf) or not text.refill():
                return value, end, None
        except RecursionError:
            start = text.where(text.pos)
            end, rid = text.extent(index)
            return None, end, Problem("too_deep", rid or f"#{index}", index, None, f"element starting at {start}")
        except json.JSONDecodeError as e:
            # Usually the element continues in the next chunk (the scan says "more"); a
            # complete element that does not parse is broken itself.
            status, end, rid = _element_extent(text.buf, text.pos)
            if status == "complete":
                return None, end, Problem(
                    "invalid_json", rid or f"#{index}", index, None,
                    f"{e.msg} at {text.where(e.pos)} (element spans {text.where(text.pos)} to {text.where(end - 1)})")
            if status == "broken" or len(text.buf) - text.pos > text.max_record_bytes or not text.refill():
                raise text.fail(e.pos, e.msg, index) from None


def _text_problem(text: _ArrayText, value: Any, index: int, end: int) -> Problem | None:
    """A ``non_utf8`` or ``lone_surrogate`` problem of the parsed element ``buf[pos:end]``, or ``None``."""
    if text.dirty and _SURROGATE.search(text.buf, text.pos, end):
        return Problem("non_utf8", _value_id(value, f"#{index}"), index, None,
                       "bytes that are not UTF-8 inside the record")
    if text.escaped and _SURROGATE_ESCAPE.search(text.buf, text.pos, end):
        return _surrogate_problem(value, index, _value_id(value, f"#{index}"))
    return None


def _list_closed(text: _ArrayText, index: int) -> bool:
    """Move past the separator after an element: ``False`` after ``,``, ``True`` at the closing ``]``.

    Raises:
        DataValidationError: the file ends, or something else follows the element.
    """
    text.skip_ws()
    if text.pos >= len(text.buf):
        raise text.fail(text.pos, "file ends inside the list (missing ']')", index)
    if text.buf[text.pos] == ",":
        text.pos += 1
        return False
    if text.buf[text.pos] == "]":
        return True
    raise text.fail(text.pos, "expected ',' or ']' between elements", index)


def iter_json_array(path: str, chunk_chars: int = 1 << 22,
                    max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[int, Any, Problem | None]]:
    """Yield ``(index, value, problem)`` for each element of a top-level JSON array.

    The file is read in chunks and split with ``json.JSONDecoder.raw_decode``, keeping
    only the unparsed tail in memory. One bad element is yielded with its problem
    (and ``value=None`` when it could not be parsed); the elements after it are read
    as usual:

    - bytes that are not UTF-8 (decoded with ``surrogateescape``): ``non_utf8``;
    - an escape such as ``\\ud800`` that is no character: ``lone_surrogate``;
    - nesting deeper than the parser follows (its ``RecursionError``): ``too_deep``;
    - broken syntax inside an object or array element: ``invalid_json`` with line and
      column, when the element's end can still be found safely (its brackets pair by
      type and its strings close on their line, see :func:`_element_extent`).

    Raises:
        DataValidationError: the file is not a JSON array, the syntax between elements
            is broken, a broken element's end cannot be found, or the file ends inside
            the list. The rest of such a file cannot be trusted, so this is fatal in
            every mode.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        text = _ArrayText(f, path, chunk_chars, max_record_bytes)
        if not _open_list(text):
            return
        index = 0
        while True:
            text.skip_ws()
            value, end, problem = _decode_element(text, decoder, index)
            if problem is None:
                problem = _text_problem(text, value, index, end)
            yield index, value, problem
            index += 1
            text.pos = end
            if _list_closed(text, index):
                return


def _read_line(f: BinaryIO, limit: int) -> tuple[bytes | bytearray | None, int, str | None]:
    """``(line, bytes read, None)`` of the next line of ``f``, or ``(None, bytes skipped, record id
    its start names)`` for a line whose text is longer than ``limit`` bytes: such a line is read
    in 1 MiB parts, held only up to ``limit``, and skipped to its end. ``(b"", 0, None)`` at the end."""
    part = f.readline(_SKIP_CHUNK)
    if part.endswith(b"\n") or len(part) < _SKIP_CHUNK:  # the whole line at once: nearly every line
        over = len(part) - part.endswith(b"\n") > limit
        return (None, len(part), _named_id(part)) if over else (part, len(part), None)
    line = bytearray(part)  # grown in place: no second copy of a long line
    while len(line) <= limit + 1 and not line.endswith(b"\n"):
        part = f.readline(_SKIP_CHUNK)
        if not part:
            break
        line += part
    size = len(line)
    if size - line.endswith(b"\n") <= limit:
        return line, size, None
    found = _named_id(bytes(line[:_SKIP_CHUNK]))
    tail = line[-1:]
    del line  # let go of it before reading on
    while tail and tail != b"\n":
        part = f.readline(_SKIP_CHUNK)
        size += len(part)
        tail = part[-1:]
    return None, size, found


def _named_id(raw: bytes) -> str | None:
    """The record id the first MiB of an over-long line names at its top level, if any."""
    text = raw[:_SKIP_CHUNK].decode("utf-8", "replace")
    return _element_extent(text, len(text) - len(text.lstrip()))[2]


def iter_jsonl(path: str, max_record_bytes: int = MAX_RECORD_BYTES,
               wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[int, Any, Problem | None]]:
    """Yield ``(line_index, value, problem)`` for each non-blank line of a JSONL file.
    ``wanted``: the lines whose position among those yielded it refuses are not decoded
    (yielded as ``(line_index, None, None)``: another process reads them).

    A line that is not UTF-8, not JSON, nested deeper than the parser follows, or holds
    an escape such as ``\\ud800`` that is no character is yielded with its problem; the
    other lines are unaffected. A line longer than ``max_record_bytes`` is a
    ``record_too_large`` problem (naming its line, and its id when the start of the line
    names one): it is held only up to the limit and the rest is skipped in reads of 1 MiB,
    so memory stays bounded by the limit however long the line is.
    """
    with open(path, "rb") as f:
        index = position = -1
        while True:
            raw, size, found = _read_line(f, max_record_bytes)
            if not size:
                return
            index += 1
            rid = f"line {index + 1}"
            if raw is None:
                position += 1
                named = f"record id {found!r}, " if found else ""
                yield index, None, Problem("record_too_large", rid, index, None,
                                           f"{named}{size} bytes, above data.validation.max_record_bytes="
                                           f"{max_record_bytes}")
                continue
            if not raw.strip():
                continue
            position += 1
            if wanted is not None and not wanted(position):
                yield index, None, None
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield index, None, Problem("non_utf8", rid, index, None, str(e))
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                yield index, None, Problem("invalid_json", rid, index, None, e.msg)
                continue
            except RecursionError:
                _, _, found = _element_extent(text, len(text) - len(text.lstrip()))
                named = f"record id {found!r}, " if found else ""
                yield index, None, Problem("too_deep", rid, index, None, f"{named}nested too deeply to parse")
                continue
            problem = None
            if _SURROGATE_ESCAPE.search(text):
                problem = _surrogate_problem(value, index, _value_id(value, rid))
            yield index, value, problem


def iter_records(path: str, max_record_bytes: int = MAX_RECORD_BYTES,
                 wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[int, Any, Problem | None]]:
    """Records of a JSON list or JSONL file, whichever it is, none read past ``max_record_bytes``
    (a JSONL line above it is a ``record_too_large`` problem; a JSON list element above it
    fails the file, whose structure cannot then be followed). ``wanted``: a JSONL file's lines
    at the positions it refuses are not decoded (see :func:`iter_jsonl`; a JSON list is parsed
    whole, to find its elements)."""
    head = b""
    with open(path, "rb") as f:
        while not head:
            chunk = f.read(4096)
            if not chunk:
                break
            head = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        yield from iter_json_array(path, max_record_bytes=max_record_bytes)
    else:
        yield from iter_jsonl(path, max_record_bytes, wanted)

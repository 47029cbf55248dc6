"""Readers: every supported file format into :class:`~mmtune.data.dialogue.Dialogue`.

Formats (``SourceConfig.format``):

- ``llava``: llava-665k. ``{"id", "image"?, "conversations": [{"from": "human"|"gpt",
  "value"}]}``; one ``<image>`` placeholder (at the start followed by a newline, or at
  the end) for a record with an ``image``; records without ``image`` are text-only. By
  default the turn holding ``<image>`` becomes ``"<image>\\n" + its stripped text``, as
  LLaVA-1.5's own preprocessing does (``SourceConfig.move_image_to_start``).
- ``mmdu``: MMDU benchmark and MMDU-45k. ``image`` is a list; the k-th ``<ImageHere>``
  in the whole dialogue is the k-th path; roles ``user``/``assistant``.
- ``xcomposer2``: InternLM-XComposer2's fine-tune JSON (same layout as ``mmdu``; roles
  ``user``/``human`` and ``assistant``/``bot``/``gpt``). Its ``data.txt`` (``path
  count_in_thousands`` per line) becomes one source per line: :func:`sources_from_datatxt`.
- ``messages``: JSONL of ``{"id"?, "messages": [{"role", "content"}]}`` where content
  is a string or a list of parts ``{"type": "text", "text"}``, ``{"type": "image_url",
  "image_url": {"url": path}}`` or ``{"type": "image", "image"|"path"|"url": path}``.

Any format may be stored as a JSON list or as JSONL; the first non-blank character
decides. A JSON list is read incrementally (:func:`iter_json_array`), so a 1.3 GB
file is never held in memory whole, and every converted, validated record goes
straight to the Arrow cache (:mod:`mmtune.data.cache`). The returned
:class:`SourceData` reads dialogues back lazily from the memory-mapped cache.

Image paths are resolved per source by :class:`mmtune.data.paths.ImagePathRules` (the
same rule evaluation uses): ``strip_image_prefix`` is removed, then relative paths and
the datasets' rooted paths (the benchmark's ``/mmdu_pics/x.jpg``) are joined under
``image_root`` (default: the data file's folder) and must stay inside it; a plain
absolute path outside it (any absolute path or ``file://`` URL in the ``messages``
format) is used only with ``data.allow_absolute_image_paths=true``. A rejected path is
a ``path_outside_root`` problem; a missing image's report shows the path tried and how
it was built.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import numpy as np

from mmtune.data.cache import CacheWriter, cache_key, entry_paths, open_entry
from mmtune.data.config import FORMATS, IMAGE_CHECKS, MODES, DataConfig, SourceConfig, default_cache_dir
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.image_limits import ImageLimits
from mmtune.data.paths import ImagePathRules, ResolvedImage
from mmtune.data.validation import DataValidationError, ImageChecker, Problem, ValidationReport, check_dialogue

LLAVA_PLACEHOLDER = "<image>"
MMDU_PLACEHOLDER = "<ImageHere>"

# Known role spellings of all formats; anything else is kept verbatim and reported as
# unknown_role by validation.
ROLE_MAP = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "system": "system",
}

_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE = re.compile("[\udc80-\udcff]")
_MAX_RECORD_CHARS = 256 * 1024 * 1024
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


# --------------------------------------------------------------------------- raw records


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


def iter_json_array(path: str, chunk_chars: int = 1 << 22) -> Iterator[tuple[int, Any, Problem | None]]:
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
        buf, pos, eof, lines_before = f.read(chunk_chars), 0, False, 0
        # Searching every record for escaped bytes costs more than parsing it; searching
        # each chunk once and records only in a "dirty" buffer costs almost nothing.
        dirty = _SURROGATE.search(buf) is not None
        escaped = _SURROGATE_ESCAPE.search(buf) is not None

        def refill() -> bool:
            nonlocal buf, pos, eof, lines_before, dirty, escaped
            if eof:
                return False
            more = f.read(chunk_chars)
            if not more:
                eof = True
                return False
            lines_before += buf.count("\n", 0, pos)
            dirty = _SURROGATE.search(buf, pos) is not None or _SURROGATE.search(more) is not None
            buf, pos = buf[pos:] + more, 0
            escaped = _SURROGATE_ESCAPE.search(buf) is not None  # also one straddling the old chunk's end
            return True

        def skip_ws() -> None:
            nonlocal pos
            while True:
                pos = _WS.match(buf, pos).end()
                if pos < len(buf) or not refill():
                    return

        def where(at: int) -> str:
            line = lines_before + buf.count("\n", 0, at) + 1
            col = at - (buf.rfind("\n", 0, at) + 1) + 1
            return f"line {line}, column {col}"

        def fail(at: int, what: str, index: int) -> DataValidationError:
            return DataValidationError(
                f"{path}: invalid JSON at {where(at)} (array element #{index}): {what}. "
                "How to fix: repair the file (e.g. `python -m json.tool FILE` shows the spot). A break in the "
                "list's own structure leaves no safe way to tell where the next record starts, so it fails the "
                "whole file; a record broken inside its own brackets is skipped alone."
            )

        def extent(index: int) -> tuple[int, str | None]:
            """End and id of the element at ``pos``, reading on as needed; fatal when none is safe."""
            while True:
                status, end, rid = _element_extent(buf, pos)
                if status == "complete":
                    return end, rid
                if status == "more" and len(buf) - pos <= _MAX_RECORD_CHARS and refill():
                    continue
                raise fail(end, "an element nested too deeply to parse, whose end cannot be found"
                           if status == "broken" else "file ends inside a deeply nested element", index)

        if buf.startswith("\ufeff"):
            pos = 1
        skip_ws()
        if pos >= len(buf) or buf[pos] != "[":
            raise fail(pos, "expected '[' at the start of a JSON list", 0)
        pos += 1
        skip_ws()
        if pos < len(buf) and buf[pos] == "]":
            return
        index = 0
        while True:
            skip_ws()
            problem = None
            while True:
                try:
                    value, end = decoder.raw_decode(buf, pos)
                    # A number ending exactly at the chunk end may continue in the next one.
                    if end < len(buf) or not refill():
                        break
                    continue
                except RecursionError:
                    start = where(pos)
                    end, rid = extent(index)
                    value, problem = None, Problem("too_deep", rid or f"#{index}", index, None,
                                                   f"element starting at {start}")
                    break
                except json.JSONDecodeError as e:
                    # Usually the element continues in the next chunk (the scan says
                    # "more"); a complete element that does not parse is broken itself.
                    status, end, rid = _element_extent(buf, pos)
                    if status == "complete":
                        value, problem = None, Problem(
                            "invalid_json", rid or f"#{index}", index, None,
                            f"{e.msg} at {where(e.pos)} (element spans {where(pos)} to {where(end - 1)})")
                        break
                    if status == "broken" or len(buf) - pos > _MAX_RECORD_CHARS or not refill():
                        raise fail(e.pos, e.msg, index) from None
            if problem is None and dirty and _SURROGATE.search(buf, pos, end):
                problem = Problem("non_utf8", _value_id(value, f"#{index}"), index, None,
                                  "bytes that are not UTF-8 inside the record")
            if problem is None and escaped and _SURROGATE_ESCAPE.search(buf, pos, end):
                problem = _surrogate_problem(value, index, _value_id(value, f"#{index}"))
            yield index, value, problem
            index += 1
            pos = end
            skip_ws()
            if pos >= len(buf):
                raise fail(pos, "file ends inside the list (missing ']')", index)
            if buf[pos] == ",":
                pos += 1
            elif buf[pos] == "]":
                return
            else:
                raise fail(pos, "expected ',' or ']' between elements", index)


def iter_jsonl(path: str) -> Iterator[tuple[int, Any, Problem | None]]:
    """Yield ``(line_index, value, problem)`` for each non-blank line of a JSONL file.

    A line that is not UTF-8, not JSON, nested deeper than the parser follows, or holds
    an escape such as ``\\ud800`` that is no character is yielded with its problem; the
    other lines are unaffected.
    """
    with open(path, "rb") as f:
        for index, raw in enumerate(f):
            if not raw.strip():
                continue
            rid = f"line {index + 1}"
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


def iter_records(path: str) -> Iterator[tuple[int, Any, Problem | None]]:
    """Records of a JSON list or JSONL file, whichever it is."""
    head = b""
    with open(path, "rb") as f:
        while not head:
            chunk = f.read(4096)
            if not chunk:
                break
            head = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        yield from iter_json_array(path)
    else:
        yield from iter_jsonl(path)


# --------------------------------------------------------------------------- conversion


@dataclass(frozen=True)
class _Context:
    source: str
    rules: ImagePathRules
    move_image_to_start: bool
    origins: dict = field(default_factory=dict)
    """Resolved path -> how it was built (for missing-image reports)."""

    def resolve(self, path: str) -> ResolvedImage:
        resolved = self.rules.resolve(path)
        if len(self.origins) < 100_000:  # bounded: only used to explain problems
            self.origins[resolved.path] = resolved.how
        return resolved


def _split(text: str, placeholder: str, images: Iterator[Image]) -> tuple:
    parts = text.split(placeholder)
    segments: list = []
    for i, part in enumerate(parts):
        if i:
            segments.append(next(images))
        if part:
            segments.append(part)
    return tuple(segments)


def _record_id(obj: dict, source: str, index: int) -> str:
    rid = obj.get("id")
    return f"{source}-{index}" if rid is None or rid == "" else str(rid)


def convert_conversations(
    obj: Any, index: int, ctx: _Context, placeholder: str
) -> tuple[Dialogue | None, list[Problem]]:
    """``llava`` / ``mmdu`` / ``xcomposer2`` record -> dialogue, or the problems preventing it."""
    if not isinstance(obj, dict):
        return None, [Problem("malformed_record", f"#{index}", index, None, f"a {type(obj).__name__}, not an object")]
    rid = _record_id(obj, ctx.source, index)

    def bad(detail: str, turn: int | None = None, code: str = "malformed_record"):
        return None, [Problem(code, rid, index, turn, detail)]

    conv = obj.get("conversations")
    if not isinstance(conv, list):
        return bad("no 'conversations' list")
    raw_images = obj.get("image")
    if raw_images is None:
        raw_images = []
    elif isinstance(raw_images, str):
        raw_images = [raw_images]
    if not isinstance(raw_images, list) or not all(isinstance(p, str) and p for p in raw_images):
        return bad("'image' must be a path or a list of non-empty paths")
    count = 0
    for t, msg in enumerate(conv):
        if not isinstance(msg, dict) or not isinstance(msg.get("value"), str) or not isinstance(msg.get("from"), str):
            return bad("turn must be an object with string 'from' and 'value'", t)
        count += msg["value"].count(placeholder)
    if count != len(raw_images):
        return bad(f"{count} {placeholder} placeholder(s), {len(raw_images)} image path(s)", None, "placeholder_mismatch")
    resolved = [ctx.resolve(p) for p in raw_images]
    for k, image in enumerate(resolved):
        if image.problem:
            seen, turn = 0, None
            for t, msg in enumerate(conv):
                seen += msg["value"].count(placeholder)
                if seen > k:
                    turn = t
                    break
            return bad(image.detail, turn, image.problem)
    images = iter([Image(image.path, image.root) for image in resolved])
    turns = []
    for msg in conv:
        value = msg["value"]
        if ctx.move_image_to_start and placeholder in value:
            # LLaVA-1.5's preprocess_multimodal: the turn holding the image becomes
            # "<image>\n" + its stripped text ("<image>" alone when there is no text)
            value = (placeholder + "\n" + value.replace(placeholder, "").strip()).strip()
        turns.append(Turn(ROLE_MAP.get(msg["from"], msg["from"]), _split(value, placeholder, images)))
    return Dialogue(rid, ctx.source, tuple(turns)), []


def _image_part_path(part: dict) -> str | None:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    else:
        url = part.get("image") or part.get("path") or part.get("url")
    return url if isinstance(url, str) and url else None


def convert_messages(obj: Any, index: int, ctx: _Context) -> tuple[Dialogue | None, list[Problem]]:
    """``messages`` record (OpenAI chat style, interleaved image parts) -> dialogue."""
    if not isinstance(obj, dict):
        return None, [Problem("malformed_record", f"#{index}", index, None, f"a {type(obj).__name__}, not an object")]
    rid = _record_id(obj, ctx.source, index)
    msgs = obj.get("messages")
    if not isinstance(msgs, list):
        return None, [Problem("malformed_record", rid, index, None, "no 'messages' list")]
    turns = []
    for t, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None, [Problem("malformed_record", rid, index, t, "message must be an object with a string 'role'")]
        content = m.get("content")
        if isinstance(content, str):
            segments: tuple = (content,) if content else ()
        elif isinstance(content, list):
            segs = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    if part["text"]:
                        segs.append(part["text"])
                elif kind in ("image_url", "image"):
                    url = _image_part_path(part)
                    if url is None:
                        return None, [Problem("malformed_record", rid, index, t, "image part without a path")]
                    if url.startswith("data:") or re.match(r"^[a-z]+://", url) and not url.startswith("file://"):
                        return None, [
                            Problem(
                                "malformed_record", rid, index, t,
                                f"image {url[:40]!r} is inline or remote: save it as a local file and use its path",
                            )
                        ]
                    image = ctx.resolve(url)
                    if image.problem:
                        return None, [Problem(image.problem, rid, index, t, image.detail)]
                    segs.append(Image(image.path, image.root))
                else:
                    return None, [Problem("malformed_record", rid, index, t, f"unknown content part {str(part)[:60]}")]
            segments = tuple(segs)
        else:
            return None, [Problem("malformed_record", rid, index, t, "'content' must be a string or a list of parts")]
        turns.append(Turn(ROLE_MAP.get(m["role"], m["role"]), segments))
    return Dialogue(rid, ctx.source, tuple(turns)), []


def _moves_image(fmt: str, setting: bool | None) -> bool:
    """``SourceConfig.move_image_to_start`` resolved: ``None`` means on for ``llava`` only."""
    return fmt == "llava" if setting is None else bool(setting)


def parse_record(
    fmt: str,
    record: Any,
    *,
    source: str = "record",
    image_root: str | None = None,
    move_image_to_start: bool | None = None,
) -> Dialogue:
    """One record of format ``fmt`` -> :class:`Dialogue`, with the same conversion (and
    defaults) as a data source; image paths are joined under ``image_root`` (default: the
    working directory) and not checked. Raises ``ValueError`` naming the problem."""
    ctx = _Context(
        source=source,
        rules=ImagePathRules(root=image_root or os.getcwd(), join_rooted=fmt != "messages"),
        move_image_to_start=_moves_image(fmt, move_image_to_start),
    )
    dialogue, problems = convert_record(fmt, record, 0, ctx)
    if dialogue is None:
        raise ValueError(f"{fmt} record {source!r}: " + "; ".join(f"{p.code}: {p.detail}" for p in problems))
    return dialogue


def convert_record(fmt: str, obj: Any, index: int, ctx: _Context) -> tuple[Dialogue | None, list[Problem]]:
    if fmt == "llava":
        return convert_conversations(obj, index, ctx, LLAVA_PLACEHOLDER)
    if fmt in ("mmdu", "xcomposer2"):
        return convert_conversations(obj, index, ctx, MMDU_PLACEHOLDER)
    if fmt == "messages":
        return convert_messages(obj, index, ctx)
    raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")


# --------------------------------------------------------------------------- sources


class DialogueSequence(Sequence):
    """Random-access, lazily converted dialogues over a memory-mapped Arrow dataset."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return self.dataset.num_rows

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"dialogue index {i} out of range for {n} dialogues")
        return Dialogue.from_record(self.dataset[int(i)])

    def __iter__(self) -> Iterator[Dialogue]:
        # Batched reads of 1000 rows as Arrow tables, converted column by column: the
        # nested segment structs come out as two flat lists (texts, image paths) plus
        # offsets, instead of one Python dict per segment.
        arrow = self.dataset.with_format("arrow")
        for start in range(0, len(self), 1000):
            yield from _dialogues_from_arrow(arrow[start : start + 1000])


def _offsets(array) -> list[int]:
    """A (possibly sliced) Arrow list array's offsets, relative to its own first value."""
    offsets = array.offsets.to_numpy()
    return (offsets - offsets[0]).tolist()


def _dialogues_from_arrow(table) -> Iterator[Dialogue]:
    """The dialogues of an Arrow table of cache rows (``Dialogue.to_record`` layout)."""
    ids = table.column("id").to_pylist()
    sources = table.column("source").to_pylist()
    roles = table.column("roles").to_pylist()
    turns_of = table.column("segments").combine_chunks()  # list<list<struct<text, image>>>
    turn_starts = _offsets(turns_of)
    segments_of = turns_of.flatten()
    segment_starts = _offsets(segments_of)
    structs = segments_of.flatten()
    texts = structs.field("text").to_pylist()
    images = structs.field("image").to_pylist()
    segments = [text if image is None else Image(image) for text, image in zip(texts, images)]
    for row, dialogue_id in enumerate(ids):
        first = turn_starts[row]
        turns = tuple(
            Turn(role, tuple(segments[segment_starts[first + k]:segment_starts[first + k + 1]]))
            for k, role in enumerate(roles[row])
        )
        yield Dialogue(id=dialogue_id, source=sources[row], turns=turns)


@dataclass
class SourceData:
    """One loaded source: its dialogues (Arrow-backed), validation report and statistics."""

    name: str
    config: SourceConfig
    dialogues: DialogueSequence
    report: ValidationReport
    cache_file: str

    def __len__(self) -> int:
        return len(self.dialogues)

    @property
    def num_images(self) -> np.ndarray:
        """Images per record (int array), read from the cache without decoding records."""
        return self.dialogues.dataset.data.column("num_images").to_numpy()

    @property
    def num_chars(self) -> np.ndarray:
        """Text characters per record (int array)."""
        return self.dialogues.dataset.data.column("num_chars").to_numpy()

    def estimated_tokens(self, tokens_per_image: int) -> np.ndarray:
        """Cheap token estimate per record: characters / 4 + ``tokens_per_image`` per image."""
        return self.num_chars // 4 + self.num_images.astype(np.int64) * tokens_per_image


def _row(d: Dialogue) -> dict[str, Any]:
    row = d.to_record()
    n_img = n_chars = 0
    for t in d.turns:
        for s in t.segments:
            if isinstance(s, str):
                n_chars += len(s)
            else:
                n_img += 1
    row["num_images"], row["num_chars"] = n_img, n_chars
    return row


def image_rules(source_cfg: SourceConfig, allow_absolute: bool = False) -> ImagePathRules:
    """The image path rule of one source: its ``image_root`` (default: the data file's folder)."""
    return ImagePathRules(
        root=os.path.abspath(source_cfg.image_root or os.path.dirname(os.path.abspath(source_cfg.path))),
        allow_absolute=allow_absolute,
        strip_prefix=source_cfg.strip_image_prefix,
        # User-made chat files carry real absolute paths; the datasets' absolute paths
        # (the benchmark's /mmdu_pics/...) are relative to where the pictures were unpacked.
        join_rooted=source_cfg.format != "messages",
    )


def load_source(
    source_cfg: SourceConfig,
    *,
    mode: str = "skip",
    cache_dir: str | None = None,
    check_images: str = "verify",
    max_examples: int = 5,
    refresh: bool = False,
    allow_absolute_image_paths: bool = False,
    image_limits: "ImageLimits | None" = None,
) -> SourceData:
    """Read, convert and validate one source, through the Arrow cache.

    Args:
        source_cfg: the source.
        mode: ``skip`` (leave bad records out, count them in the report) or ``strict``
            (raise at the first problem).
        cache_dir: cache folder; ``None`` = :func:`~mmtune.data.config.default_cache_dir`.
        check_images: ``verify`` | ``exists`` | ``none`` (see ``ValidationConfig``).
        max_examples: example ids kept per problem class.
        refresh: rebuild the cache entry even if one exists.
        allow_absolute_image_paths: accept absolute image paths outside the image root
            (see :mod:`mmtune.data.paths`).
        image_limits: largest images accepted by the ``verify`` / ``decode`` checks (the
            model's ``model.image_limits``; default: the defaults); others are ``image_too_large``.

    Raises:
        FileNotFoundError: the data file does not exist.
        DataValidationError: strict mode and a problem (also when the problem was found
            by an earlier cached run), or a broken JSON list in any mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown: use skip or strict")
    if check_images not in IMAGE_CHECKS:
        raise ValueError(f"check_images={check_images!r} is unknown: use one of {', '.join(IMAGE_CHECKS)}")
    if source_cfg.format not in FORMATS:
        raise ValueError(f"source {source_cfg.name!r}: format={source_cfg.format!r} is unknown: use one of {', '.join(FORMATS)}")
    path = source_cfg.path
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"source {source_cfg.name!r}: data file {path!r} does not exist "
            "(set the source's path, or MMTUNE_DATA_ROOT for the shipped configs)"
        )
    image_root = os.path.abspath(source_cfg.image_root) if source_cfg.image_root else None
    limits = image_limits or ImageLimits()
    ctx = _Context(
        source_cfg.name,
        image_rules(source_cfg, allow_absolute_image_paths),
        _moves_image(source_cfg.format, source_cfg.move_image_to_start),
    )
    options = {
        "name": source_cfg.name,
        "format": source_cfg.format,
        "image_root": image_root,
        "strip_image_prefix": source_cfg.strip_image_prefix,
        "move_image_to_start": source_cfg.move_image_to_start,
        "allow_absolute_image_paths": allow_absolute_image_paths,
        "check_images": check_images,
        "max_examples": max_examples,
    }
    if check_images in ("verify", "decode"):  # what a header check accepts is part of the entry
        options["image_limits"] = asdict(limits)
    arrow_path, report_path = entry_paths(cache_dir or default_cache_dir(), source_cfg.name, cache_key(path, options))
    hit = None if refresh else open_entry(arrow_path, report_path)
    if hit is not None:
        dataset, report_dict = hit
        report = ValidationReport.from_dict(report_dict)
        if mode == "strict" and report.first_problem:
            raise DataValidationError(f"{report.first_problem} (found when the cache was built: {report_path})")
    else:
        report = _build(source_cfg, ctx, mode, ImageChecker(check_images, limits), max_examples, arrow_path,
                        report_path)
        dataset = open_entry(arrow_path, report_path)[0]
    return SourceData(source_cfg.name, source_cfg, DialogueSequence(dataset), report, arrow_path)


def _explain(problem: Problem, ctx: _Context) -> Problem:
    """A missing image's problem with the path tried and how it was built."""
    if problem.code != "missing_image":
        return problem
    how = ctx.origins.get(problem.detail)
    return replace(problem, detail=f"tried {problem.detail}, built as {how}") if how else problem


def _checked_records(source_cfg: SourceConfig, ctx: _Context, checker: ImageChecker,
                     limit: int | None = None) -> Iterator[tuple[Dialogue | None, list[Problem]]]:
    """``(dialogue, problems)`` of every record of the source, in file order: each record
    converted and checked (:func:`check_dialogue`, duplicate ids); ``dialogue`` is None when
    the record could not be converted. ``limit``: only the first records."""
    seen: set[str] = set()
    for index, obj, problem in iter_records(source_cfg.path):
        if limit is not None and index >= limit:
            return
        dialogue = None
        if problem is not None:
            problems = [problem]
        else:
            try:
                dialogue, problems = convert_record(source_cfg.format, obj, index, ctx)
            except RecursionError:  # parsed, but too deep for the conversion (e.g. a nested id)
                dialogue, problems = None, [Problem("too_deep", f"#{index}", index, None, "while converting")]
            if dialogue is not None:
                problems = [_explain(p, ctx) for p in check_dialogue(dialogue, index, checker)]
                if dialogue.id in seen:
                    problems.append(Problem("duplicate_id", dialogue.id, index, None, "id seen earlier"))
                seen.add(dialogue.id)
            if problems and _system_first(obj):
                problems = [replace(p, system_first=True) for p in problems]
        yield dialogue, problems


def _build(source_cfg, ctx, mode, checker, max_examples, arrow_path, report_path) -> ValidationReport:
    path = source_cfg.path
    report = ValidationReport(source_cfg.name, path, source_cfg.format, checker.level, max_examples)
    writer = CacheWriter(arrow_path, report_path)
    try:
        for dialogue, problems in _checked_records(source_cfg, ctx, checker):
            if problems:
                if mode == "strict":
                    raise DataValidationError(problems[0].message(path))
                report.add_skipped(problems)
            else:
                report.add_kept(dialogue)
                writer.add(_row(dialogue))
        writer.commit(report.to_dict())
    except BaseException:
        writer.abort()
        raise
    return report


def _system_first(obj: Any) -> bool:
    """Whether a raw record's first message is a system message (turn numbering skips it)."""
    turns = obj.get("conversations", obj.get("messages")) if isinstance(obj, dict) else None
    first = turns[0] if isinstance(turns, list) and turns else None
    role = (first.get("from", first.get("role")) if isinstance(first, dict) else None)
    return isinstance(role, str) and ROLE_MAP.get(role, role) == "system"


def read_source(
    source_cfg: SourceConfig,
    *,
    check_images: str = "none",
    allow_absolute_image_paths: bool = False,
    image_limits: "ImageLimits | None" = None,
    limit: int | None = None,
) -> list[tuple[Dialogue | None, list[Problem]]]:
    """Every record of one source converted and checked as :func:`load_source` does, without
    the Arrow cache: ``(dialogue, problems)`` per record in file order (``dialogue`` None when
    the record could not be converted; ``problems`` empty for a good record).

    For readers that must refuse a file with any bad record rather than skip it (evaluation
    benchmarks: a dropped item would change the score). ``limit``: only the first records.

    Raises:
        DataValidationError: the file's JSON list structure is broken (see :func:`iter_json_array`).
    """
    if check_images not in IMAGE_CHECKS:
        raise ValueError(f"check_images={check_images!r} is unknown: use one of {', '.join(IMAGE_CHECKS)}")
    ctx = _Context(source_cfg.name, image_rules(source_cfg, allow_absolute_image_paths),
                   _moves_image(source_cfg.format, source_cfg.move_image_to_start))
    return list(_checked_records(source_cfg, ctx, ImageChecker(check_images, image_limits), limit))


def load_sources(data_cfg: DataConfig, *, refresh: bool = False,
                 image_limits: "ImageLimits | None" = None) -> list[SourceData]:
    """Every source of a data config, with its validation and cache settings (and the model's image limits)."""
    v = data_cfg.validation
    return [
        load_source(
            s,
            mode=v.mode,
            cache_dir=data_cfg.cache_dir,
            check_images=v.check_images,
            max_examples=v.max_examples,
            refresh=refresh,
            allow_absolute_image_paths=data_cfg.allow_absolute_image_paths,
            image_limits=image_limits,
        )
        for s in data_cfg.mixture.sources
    ]


def read_datatxt(path: str) -> list[tuple[str, float]]:
    """InternLM-XComposer2 ``data.txt``: ``(json_path, sample_count_in_thousands)`` per line.

    Relative JSON paths are taken relative to the ``data.txt`` folder. Blank lines and
    ``#`` comments are ignored.

    Raises:
        DataValidationError: a line does not have a path and a number.
    """
    entries, problems = [], []
    base = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                count = float(parts[1])
            except ValueError:
                problems.append(f"{path}:{n}: expected 'path count_in_thousands', got {line!r}")
                continue
            entries.append((parts[0] if os.path.isabs(parts[0]) else os.path.join(base, parts[0]), count))
    if problems:
        raise DataValidationError("invalid data.txt:\n  " + "\n  ".join(problems))
    return entries


def sources_from_datatxt(path: str, *, image_root: str | None = None, prefix: str = "xc2") -> list[SourceConfig]:
    """One ``xcomposer2`` source per ``data.txt`` line, drawing ``count * 1000`` samples.

    The XComposer2 scripts use the count as the number of samples taken from each file
    per epoch; here it becomes ``SourceConfig.num_samples`` (fewer = fixed subset, more =
    repeats), which the mixture honours when ``weights`` is unset.
    """
    return [
        SourceConfig(
            name=f"{prefix}_{i}_{os.path.splitext(os.path.basename(p))[0]}",
            format="xcomposer2",
            path=p,
            image_root=image_root,
            num_samples=int(round(count * 1000)),
        )
        for i, (p, count) in enumerate(read_datatxt(path))
    ]


__all__ = [
    "LLAVA_PLACEHOLDER",
    "MMDU_PLACEHOLDER",
    "ROLE_MAP",
    "iter_json_array",
    "iter_jsonl",
    "iter_records",
    "surrogate_problem",
    "convert_record",
    "DialogueSequence",
    "SourceData",
    "image_rules",
    "load_source",
    "load_sources",
    "read_source",
    "read_datatxt",
    "sources_from_datatxt",
]

"""Reading the builder's input corpus: one JSONL entry per line, bad entries reported, never fatal.

An entry::

    {"id": "eiffel", "images": ["pics/eiffel.jpg", "pics/night.jpg"],
     "captions": ["The tower from the Champ de Mars", "The tower lit at night"],
     "tags": ["landmark", "Paris"], "text": "The Eiffel Tower is ..."}

Image paths follow the data layer's rules: relative paths are joined under
``image_root`` (or the corpus file's folder), absolute paths are kept. An image that is
missing or cannot be opened is dropped from its entry (counted); an entry left with no
image, or that is not a well-formed object, is skipped with a reason.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

from mmtune.data.validation import ImageChecker

# reason -> how to fix it (shown in the report)
SKIP_REASONS = {
    "invalid_json": "each line must be one JSON object",
    "malformed_entry": "give the entry an 'images' list of paths (captions/tags lists of strings, text a string)",
    "no_usable_image": "every image of the entry is missing or broken: restore the files or check corpus.image_root",
    "duplicate_id": "give every entry a unique id (the first one is kept)",
}


@dataclass(frozen=True)
class CorpusEntry:
    """One corpus entry with resolved, checked image paths (``captions[i]`` describes ``images[i]``)."""

    id: str
    images: tuple[str, ...]
    captions: tuple[str, ...]
    tags: tuple[str, ...] = ()
    text: str = ""

    def embedding_text(self) -> str:
        """What the entry is clustered by: its tags, then its captions (paper §2.2)."""
        return " ; ".join([*self.tags, *self.captions])


@dataclass
class CorpusReport:
    """Counts of one corpus read: what was kept, what was skipped and why."""

    path: str
    entries_read: int = 0
    entries_kept: int = 0
    images_kept: int = 0
    images_dropped: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(where)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        lines = [
            f"corpus {self.path}",
            f"  entries  read {self.entries_read}, kept {self.entries_kept}, "
            f"skipped {self.entries_read - self.entries_kept}; images kept {self.images_kept}",
        ]
        for code, n in sorted(self.images_dropped.items(), key=lambda kv: -kv[1]):
            lines.append(f"  images dropped ({code}): {n}")
        for code, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            lines.append(f"  skipped {code:<18} {n:>7}  fix: {SKIP_REASONS[code]}")
            for ex in self.examples.get(code, []):
                lines.append(f"  {'':<26}  e.g. {ex}")
        return "\n".join(lines)


def _strings(value: Any) -> Optional[list[str]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _parse(obj: Any, line_no: int, root: str) -> tuple[Optional[dict], str]:
    if not isinstance(obj, dict):
        return None, f"a {type(obj).__name__}, not an object"
    images = _strings(obj.get("images", obj.get("image")))
    captions = _strings(obj.get("captions", obj.get("caption")))
    tags = _strings(obj.get("tags", obj.get("categories")))
    text = obj.get("text", "")
    if not images or any(not p for p in images):
        return None, "no 'images' list of non-empty paths"
    if captions is None or tags is None or not isinstance(text, str):
        return None, "'captions'/'tags' must be strings or lists of strings and 'text' a string"
    if captions and len(captions) != len(images):
        return None, f"{len(captions)} captions for {len(images)} images"
    captions = captions or [""] * len(images)
    rid = obj.get("id")
    rid = f"entry-{line_no}" if rid is None or rid == "" else str(rid)
    paths = [p if os.path.isabs(p) else os.path.join(root, p) for p in images]
    return {"id": rid, "images": paths, "captions": captions, "tags": tags, "text": text}, ""


def iter_corpus(
    path: str, *, image_root: Optional[str] = None, check_images: str = "verify", limit: Optional[int] = None,
    report: Optional[CorpusReport] = None,
) -> Iterator[CorpusEntry]:
    """Stream the usable entries of a JSONL corpus; problems go to ``report``.

    Raises:
        FileNotFoundError: the corpus file does not exist.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file {path!r} does not exist (set corpus.path in the build config)")
    report = report if report is not None else CorpusReport(path)
    root = os.path.abspath(image_root) if image_root else os.path.dirname(os.path.abspath(path))
    checker = ImageChecker(check_images)
    seen: set[str] = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and report.entries_read >= limit:
                break
            report.entries_read += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                report.skip("invalid_json", f"line {line_no}: {e.msg}")
                continue
            parsed, why = _parse(obj, line_no, root)
            if parsed is None:
                report.skip("malformed_entry", f"line {line_no}: {why}")
                continue
            if parsed["id"] in seen:
                report.skip("duplicate_id", f"line {line_no}: id {parsed['id']!r}")
                continue
            keep_images, keep_captions = [], []
            for img, cap in zip(parsed["images"], parsed["captions"]):
                bad = checker.check(img)
                if bad is None:
                    keep_images.append(img)
                    keep_captions.append(cap)
                else:
                    report.images_dropped[bad[0]] = report.images_dropped.get(bad[0], 0) + 1
            if not keep_images:
                report.skip("no_usable_image", f"line {line_no}: id {parsed['id']!r}")
                continue
            seen.add(parsed["id"])
            report.entries_kept += 1
            report.images_kept += len(keep_images)
            yield CorpusEntry(
                parsed["id"], tuple(keep_images), tuple(keep_captions), tuple(parsed["tags"]), parsed["text"]
            )


def read_corpus(
    path: str, *, image_root: Optional[str] = None, check_images: str = "verify", limit: Optional[int] = None
) -> tuple[list[CorpusEntry], CorpusReport]:
    """All usable entries of a corpus and the report of what was left out."""
    report = CorpusReport(path)
    entries = list(iter_corpus(path, image_root=image_root, check_images=check_images, limit=limit, report=report))
    return entries, report


__all__ = ["CorpusEntry", "CorpusReport", "SKIP_REASONS", "iter_corpus", "read_corpus"]

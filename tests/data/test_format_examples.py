"""The example record of each format in docs/data.md, read by the real readers.

Each json block after a ``<!-- format example: <fmt> -->`` comment is written to a data file
as that format's files are written (a JSON list, or one JSONL line for ``messages``), its
format detected as ``mmtune data check FILE`` detects it, read and validated in strict mode
with every image opened, and compared with the Dialogue the page says it becomes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from PIL import Image as PILImage

from mmtune.data.config import SourceConfig
from mmtune.data.formats import detect_format, format_names, get_format
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.readers import load_source

PAGE = Path(__file__).resolve().parents[2] / "docs" / "data.md"
#: the formats shipped with mmtune (a test may have registered others)
BUILT_IN = [name for name in format_names() if type(get_format(name)).__module__.startswith("mmtune.data.formats.")]
EXAMPLE = re.compile(r"<!-- format example: (\w+) -->\s*\n```json\n(.*?)\n```", re.S)


def page_examples() -> dict[str, dict]:
    found = EXAMPLE.findall(PAGE.read_text())
    examples = {fmt: json.loads(body) for fmt, body in found}
    assert len(examples) == len(found), "docs/data.md shows one example per format"
    return examples


def expected(fmt: str, pics: Path) -> Dialogue:
    """What docs/data.md says each example becomes (its "becomes ..." line)."""
    a, b = Image(str(pics / "a.jpg")), Image(str(pics / "b.jpg"))
    turns = {
        "llava": [Turn("user", (a, "\nWhat is in the picture?")), Turn("assistant", ("A red square.",)),
                  Turn("user", ("Is it large?",)), Turn("assistant", ("No, small.",))],
        "mmdu": [Turn("user", ("Image1: ", a, ". What shape is in Image1?")), Turn("assistant", ("A square.",)),
                 Turn("user", ("Image2: ", b, ". Do Image1 and Image2 have the same color?")),
                 Turn("assistant", ("No: red and blue.",))],
        "xcomposer2": [Turn("user", (a, "Describe the image.")), Turn("assistant", ("A red square on white.",))],
        "messages": [Turn("system", ("Be brief.",)), Turn("user", ("Compare ", a, " and ", b)),
                     Turn("assistant", ("The first is red, the second blue.",))],
    }[fmt]
    ids = {"llava": "llava-1", "mmdu": "mmdu-1", "xcomposer2": "xc2-1", "messages": "msg-1"}
    return Dialogue(ids[fmt], fmt, tuple(turns))


def test_docs_show_one_example_of_every_format():
    assert sorted(page_examples()) == sorted(BUILT_IN)


@pytest.mark.parametrize("fmt", BUILT_IN)
def test_the_docs_example_is_detected_and_read_as_the_docs_say(fmt, tmp_path):
    record = page_examples()[fmt]
    pics = tmp_path / "pics"
    pics.mkdir()
    for name, rgb in (("a.jpg", (220, 40, 40)), ("b.jpg", (40, 70, 220))):
        PILImage.new("RGB", (32, 32), rgb).save(pics / name)
    if fmt == "messages":
        path = tmp_path / "data.jsonl"
        path.write_text(json.dumps(record) + "\n")
    else:
        path = tmp_path / "data.json"
        path.write_text(json.dumps([record], indent=1))
    assert detect_format(str(path))[0] == fmt
    source = load_source(SourceConfig(name=fmt, format=fmt, path=str(path)), mode="strict",
                         cache_dir=str(tmp_path / "cache"), check_images="decode")
    assert source.report.records_kept == 1
    assert list(source.dialogues) == [expected(fmt, pics)]

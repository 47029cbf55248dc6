"""A new data format is one module: ``toy_format.py`` beside this file.

Once imported, the format is detected and read by ``mmtune data check``, accepted by
``--format`` and by a source's ``format``, and loaded into the Arrow cache like a built-in
one; nothing under ``src/`` or ``configs/`` names it.
"""

import json
import re
from pathlib import Path

from PIL import Image as PILImage

import tests.data.toy_format as toy
from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.data.check import main
from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
from mmtune.data.readers import load_source

ROOT = Path(__file__).resolve().parents[2]


def _file(tmp_path: Path) -> Path:
    PILImage.new("RGB", (16, 16), (200, 30, 30)).save(tmp_path / "red.png")
    records = [{"qa_id": "q1", "picture": "red.png", "question": "Which colour?", "answer": "Red."},
               {"qa_id": "q2", "picture": "gone.png", "question": "And this one?", "answer": "Blue."}]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_nothing_in_mmtune_names_the_toy_format():
    named = [str(p) for folder in ("src", "configs") for p in (ROOT / folder).rglob("*")
             if p.is_file() and p.suffix in (".py", ".yaml", ".md") and re.search(r"\btoyqa\b", p.read_text())]
    assert named == []


def test_data_check_detects_it_and_reports_each_record(tmp_path, capsys):
    path = _file(tmp_path)
    assert main(["check", str(path), "--cache-dir", str(tmp_path / "cache")]) == 1
    captured = capsys.readouterr()
    assert f"{path}: format toyqa (detected: records have qa_id, picture, question and answer (toy QA)" in captured.out
    assert "kept 1, skipped 1" in captured.out and "missing_image" in captured.out and "q2" in captured.out
    assert main(["check", str(path), "--format", toy.ToyQA.name, "--allow-skips",
                 "--cache-dir", str(tmp_path / "cache")]) == 0


def test_a_file_of_no_format_lists_its_keys(tmp_path, capsys):
    path = tmp_path / "other.json"
    path.write_text(json.dumps([{"text": "hi"}]))
    assert main(["check", str(path), "--cache-dir", str(tmp_path / "cache")]) == 2
    assert f"{toy.ToyQA.keys} (toyqa)" in capsys.readouterr().err


def test_it_loads_into_the_cache_as_a_built_in_format_does(tmp_path):
    path = _file(tmp_path)
    source = SourceConfig(name="qa", format="toyqa", path=str(path))
    DataConfig(mixture=MixtureConfig(sources=[source])).validate()  # the format is a known one
    loaded = load_source(source, cache_dir=str(tmp_path / "cache"), check_images="exists")
    assert loaded.report.records_kept == 1 and loaded.report.skipped == {"missing_image": 1}
    assert list(loaded.dialogues) == [Dialogue("q1", "qa", (Turn("user", (Image(str(tmp_path / "red.png")), "Which colour?")),
                                                             Turn("assistant", ("Red.",))))]

"""The tiny checkpoints of :data:`mmtune.testing.checkpoints.KINDS` stay what they were: every file a
checkpoint is written with (config, processor config, tokenizer, chat template, generation config;
the tiny processor and the one with the released image settings) against ``tiny_kinds.json``, the
digests of the checkpoints the builders wrote before they became one entry per class.

A change to a class's checkpoint that is meant (a new class, new sizes) rewrites the snapshot::

    PYTHONPATH=src python -m tests.testing.test_checkpoints --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from mmtune.testing.checkpoints import KINDS

SNAPSHOT = Path(__file__).with_name("tiny_kinds.json")
MODES = {"tiny": False, "released": True}


def _canonical(path: Path) -> bytes:
    """A file's bytes; a JSON file without the transformers version that wrote it, keys sorted."""
    if path.suffix != ".json":
        return path.read_bytes()

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "transformers_version"}
        return [strip(v) for v in value] if isinstance(value, list) else value

    return json.dumps(strip(json.loads(path.read_text())), sort_keys=True, ensure_ascii=False).encode()


def digests(kind: str, released: bool, directory: Path) -> dict[str, str]:
    """sha256 of each file of a weightless tiny checkpoint of ``kind`` written to ``directory``."""
    from mmtune.testing.checkpoints import save_tiny_checkpoint

    save_tiny_checkpoint(str(directory), kind, weights=False, released_sizes=released)
    return {f.name: hashlib.sha256(_canonical(f)).hexdigest() for f in sorted(directory.iterdir())}


def _expected() -> dict[str, dict[str, dict[str, str]]]:
    return json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(_expected()))
def test_every_file_of_a_tiny_checkpoint_is_what_it_was(kind, mode, tmp_path):
    found = digests(kind, MODES[mode], tmp_path)
    expected = _expected()[kind][mode]
    changed = sorted(name for name in expected.keys() | found.keys() if expected.get(name) != found.get(name))
    assert not changed, f"{kind} ({mode} image sizes): {changed} differ from {SNAPSHOT.name}"


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_class_has_its_model_yaml(kind):
    """Each class of :data:`KINDS` is one entry there and one ``configs/model/<class>_tiny.yaml`` on the
    checkpoint ``scripts/tiny_checkpoint.py <class>`` writes."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "configs" / "model" / f"{kind}_tiny.yaml"
    assert path.is_file(), f"{kind}: no {path}"
    config = yaml.safe_load(path.read_text())
    assert (config["family"], config["path"]) == ("auto", f"outputs/tiny/{kind}")


def _write() -> None:  # pragma: no cover - run by hand, see the module docstring
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        table = {kind: {mode: digests(kind, released, Path(root) / kind / mode) for mode, released in MODES.items()}
                 for kind in sorted(KINDS)}
    SNAPSHOT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT} ({len(table)} classes)")


if __name__ == "__main__" and "--write" in sys.argv:
    _write()

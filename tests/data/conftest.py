"""Fixtures for the data-layer tests: tiny real images and data files written on the fly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image as PILImage


def _write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    return path


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def write_json():
    """``write_json(path, records)``: a JSON list file."""
    return _write_json


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, records)``: one JSON object per line."""
    return _write_jsonl


@pytest.fixture
def pics(tmp_path: Path) -> Path:
    """A folder with a.png, b.jpg, c.png (8x8 real images), broken.png (not an image) and
    thin.png (a 1 x 30000 PNG of under 200 bytes: padded to a square it would be 30000 x 30000)."""
    root = tmp_path / "pics"
    root.mkdir()
    PILImage.new("RGB", (8, 8), (255, 0, 0)).save(root / "a.png")
    PILImage.new("RGB", (8, 8), (0, 255, 0)).save(root / "b.jpg")
    PILImage.new("RGB", (8, 8), (0, 0, 255)).save(root / "c.png")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nthis is not a png body")
    PILImage.new("L", (1, 30000)).save(root / "thin.png", optimize=True)
    return root


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    return str(tmp_path / "cache")


@pytest.fixture(scope="module")
def adapter_576():
    """The tiny LLaVA adapter at LLaVA-1.5's real image size: 336 px / 14 px patches = 576 tokens
    per image. Only the tokenizer and config are built; no model, and no image file is opened."""
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    return build_adapter(ModelConfig(family="llava", image_size=336))

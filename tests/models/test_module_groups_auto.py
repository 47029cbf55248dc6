"""The ``auto`` family's module groups (:func:`mmtune.models.base.find_module_groups`) for every
tested class, built on the meta device from its tiny config: each group's parameter names against
``module_groups_auto.json``, the groups found before image-generation modules got a group of their
own (Janus's VQ model and generation heads, now ``frozen``). Any other change to a class's groups
fails here. A meant change rewrites the snapshot::

    PYTHONPATH=src python -m tests.models.test_module_groups_auto --write
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mmtune.testing.checkpoints import KINDS

SNAPSHOT = Path(__file__).with_name("module_groups_auto.json")
GROUPS = ("vision", "projector", "language_model", "frozen")


def groups_of(kind: str) -> dict[str, list[str]]:
    """Parameter names per group of ``kind``'s tiny model on the meta device."""
    import torch
    from transformers import AutoModelForImageTextToText

    from mmtune.models.base import find_module_groups
    from mmtune.testing.checkpoints import tiny_model_config, tiny_tokenizer

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(tiny_model_config(kind, tiny_tokenizer(kind)))
    groups = find_module_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    return {group: sorted({names[id(p)] for m in getattr(groups, group, []) for p in m.parameters()})
            for group in GROUPS}


def _writes_images(kind: str) -> bool:
    """Whether transformers' class of ``kind`` generates images (its ``output_modalities``)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    model_class = AutoModelForImageTextToText._model_mapping[AutoConfig.for_model(KINDS[kind].model_type).__class__]
    return "image" in getattr(model_class, "output_modalities", ())


def _expected() -> dict[str, dict[str, list[str]]]:
    return json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}


@pytest.mark.parametrize("kind", sorted(_expected()))
def test_module_groups_are_what_they_were(kind):
    """The vision tower and language model as before; the projector as before less what moved to
    ``frozen``, which only a class that writes images has."""
    found, expected = groups_of(kind), _expected()[kind]
    for group in ("vision", "language_model"):
        assert found[group] == expected.get(group, []), f"{kind}: the {group} group changed"
    assert sorted(found["projector"] + found["frozen"]) == expected.get("projector", []), f"{kind}: projector changed"
    assert bool(found["frozen"]) == _writes_images(kind), f"{kind}: frozen {found['frozen'][:4]}"


def test_janus_generation_modules_are_frozen_and_its_aligner_stays_the_projector():
    """Janus reads an image through its vision model and aligner; its VQ model, generation embeddings,
    aligner and head only write images, so image-text training never updates them."""
    found = groups_of("janus")
    assert found["projector"] and all(n.startswith("model.aligner.") for n in found["projector"])
    tops = {".".join(n.split(".")[:2]) for n in found["frozen"]}
    assert tops == {"model.vqmodel", "model.generation_embeddings", "model.generation_aligner",
                    "model.generation_head"}


def _snapshot_groups(kind: str) -> dict[str, list[str]]:
    """:func:`groups_of` as the snapshot holds it: ``frozen`` counted with the projector, as before it
    was a group of its own (what :func:`test_module_groups_are_what_they_were` compares)."""
    found = groups_of(kind)
    found["projector"] = sorted(found["projector"] + found.pop("frozen"))
    return {group: names for group, names in found.items() if names}


def _write() -> None:  # pragma: no cover - run by hand, see the module docstring
    table = {kind: _snapshot_groups(kind) for kind in sorted(KINDS)}
    SNAPSHOT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT} ({len(table)} classes)")


if __name__ == "__main__" and "--write" in sys.argv:
    _write()


def test_janus_dummy_image_runs_its_reading_path_and_adds_zero():
    """The dummy image a text-only micro-batch runs (``vision_dummy_loss``) reaches Janus's
    ``get_image_features``, which transformers keeps on its body: exactly 0, zero gradients for the
    vision model and aligner, none for the generation modules."""
    from tests.support.auto_checkpoints import adapter

    auto = adapter("janus")
    model = auto.load_model()
    loss = auto.vision_dummy_loss(model)
    loss.backward()
    groups = auto.module_groups(model)
    assert loss.item() == 0.0
    read = [p for group in (groups.vision, groups.projector) for m in group for p in m.parameters()]
    assert read and all(p.grad is not None and not p.grad.any() for p in read)
    assert groups.frozen and all(p.grad is None for m in groups.frozen for p in m.parameters())

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


def _expected() -> dict[str, dict[str, list[str]]]:
    return json.loads(SNAPSHOT.read_text()) if SNAPSHOT.exists() else {}


@pytest.mark.parametrize("kind", sorted(_expected()))
def test_module_groups_are_what_they_were(kind):
    found, expected = groups_of(kind), _expected()[kind]
    for group in GROUPS:
        assert found[group] == expected.get(group, []), f"{kind}: the {group} group changed"


def _write() -> None:  # pragma: no cover - run by hand, see the module docstring
    table = {kind: {g: names for g, names in groups_of(kind).items() if names} for kind in sorted(KINDS)}
    SNAPSHOT.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT} ({len(table)} classes)")


if __name__ == "__main__" and "--write" in sys.argv:
    _write()

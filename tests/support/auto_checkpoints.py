"""Tiny checkpoints of the ``auto`` family's tested classes, each written once per test process
(``mmtune.testing.checkpoints``) and shared by the tests of every room that runs them."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

from mmtune.testing.checkpoints import KINDS

#: the tested classes, by the names of :data:`mmtune.testing.checkpoints.KINDS`
CLASSES = tuple(KINDS)

#: what a downstream test cannot show yet for a class, and why: each an xfail(strict=True) there
GAPS: dict[str, dict[str, str]] = {
    "packing": {"hunyuan_vl": "transformers' HunYuanVLTextModel refuses the position layout [1 + 4, B, L] it "
                              "reads packed boundaries from (5.25): packing is refused at start-up"},
    # keyed by the test's case id, "<class>-<mode>"
    "sft": {},
}


#: classes whose run of a test is in the slow suite only (CI runs it): each beside a class of the same
#: line and kind of layers that the default suite runs it for (named as the value)
SLOW: dict[str, dict[str, str]] = {
    "packing": {"smolvlm": "idefics3", "aya_vision": "cohere2_vision", "gemma4": "gemma3", "glm46v": "glm4v_moe",
                "llava_next": "llava_onevision", "qwen3_5_moe": "qwen3_5"},
}


def cases(test: str) -> list:
    """:data:`CLASSES` as pytest parameters, the :data:`GAPS` of ``test`` marked xfail (strict) and its
    :data:`SLOW` classes marked slow."""
    import pytest

    gaps, slow = GAPS.get(test, {}), SLOW.get(test, {})

    def marks(kind: str) -> list:
        return ([pytest.mark.xfail(strict=True, reason=gaps[kind])] if kind in gaps else []) + (
            [pytest.mark.slow] if kind in slow else [])

    return [pytest.param(kind, marks=marks(kind)) for kind in CLASSES]

_ROOT = tempfile.mkdtemp(prefix="mmtune-auto-checkpoints-")
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def checkpoint(kind: str) -> str:
    """The directory of a tiny random-weight checkpoint of ``kind`` (weights seeded with 0)."""
    from mmtune.testing.checkpoints import save_tiny_checkpoint

    return save_tiny_checkpoint(f"{_ROOT}/{kind}", kind)


@functools.lru_cache(maxsize=None)
def adapter(kind: str):
    """The ``auto`` adapter of :func:`checkpoint` (one per process: building it probes the processor)."""
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    return build_adapter(ModelConfig(family="auto", path=checkpoint(kind)))


def labelled_runs(labels) -> list[list[int]]:
    """The runs of consecutive labelled (not ignored) token ids in ``labels``, in order."""
    from mmtune.core.encoded import IGNORE_INDEX

    runs, current = [], []
    for label in list(labels) + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(current)
            current = []
    return runs

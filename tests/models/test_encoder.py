"""The one encoder (models/encoder.py): every transformers family is a specialisation of it that
replaces only the stages named in its docs, the shared stages exist once, and the start-up check
against the processor covers the families whose text follows their official training code (their
image inputs against the image processor; their text against that code in the golden tests)."""

import dataclasses
import logging

import pytest

import mmtune.models.authority as authority
from mmtune.models.auto import AutoAdapter
from mmtune.models.authority import ProcessorAuthority, ProcessorMismatchError
from mmtune.models.config import ModelConfig
from mmtune.models.encoder import Encoder
from mmtune.models.hooks import TransformersModelHooks
from mmtune.models.llava import LlavaAdapter
from mmtune.models.positions import RopePositions
from mmtune.models.qwen2_vl import Qwen2VLAdapter
from mmtune.models.registry import build_adapter

#: the steps of the encoder a family may replace, by stage
STAGE_STEPS = {"profile": "_load_profile", "images": "_setup_images", "text": "_setup_text",
               "authority": "_check_probe"}
#: the stages each family replaces (docs/architecture.md's table)
REPLACED = {
    AutoAdapter: {"profile", "images", "text", "authority"},
    LlavaAdapter: {"profile", "images", "text"},
    Qwen2VLAdapter: {"profile", "images", "text"},
}
#: what no family replaces: positions and the model hooks (a family names the class it loads,
#: ``generation_class``, and where a prompt's image inputs come from, ``_prompt_inputs``)
SHARED = [name for owner in (RopePositions, TransformersModelHooks) for name in vars(owner)
          if callable(vars(owner)[name]) and not name.startswith("__")
          and name not in ("generation_class", "_prompt_inputs")]
SHARED += ["_setup_positions", "_check_authority", "_compare_images"]


@pytest.mark.parametrize("family", list(REPLACED), ids=lambda c: c.family)
def test_each_family_replaces_only_its_stages(family):
    assert issubclass(family, Encoder) and family.__init__ is Encoder.__init__
    replaced = {stage for stage, step in STAGE_STEPS.items()
                if getattr(family, step) is not getattr(Encoder, step, getattr(ProcessorAuthority, step, None))}
    assert replaced == REPLACED[family]
    for name in SHARED:
        assert getattr(family, name) is getattr(Encoder, name), f"{family.__name__}.{name} is not the encoder's"


@pytest.mark.parametrize("case", ["llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_family_positions_come_from_the_shared_stage(case):
    config = ModelConfig(family="llava") if case == "llava" else ModelConfig(
        family="qwen2_vl", architecture={"model_type": case})
    adapter = build_adapter(config)
    if case == "llava":
        assert adapter._rope is None and adapter.position_id_rows == 1
    else:  # the inner model class transformers pairs with the config: its own get_rope_index
        assert type(adapter._rope.model).__name__ == type(adapter.model_config).__name__.replace("Config", "Model")
        assert adapter.position_id_rows == 3 and adapter.packing_problem == ""


def _fresh_check(monkeypatch):
    monkeypatch.setattr(authority, "_CHECKED", set())


def test_llava_image_stage_is_checked_against_the_image_processor_at_start_up(monkeypatch, caplog):
    adapter = build_adapter(ModelConfig(family="llava"))
    _fresh_check(monkeypatch)
    with caplog.at_level(logging.INFO, logger="mmtune.models.authority"):
        adapter._check_authority()  # passes: pad-to-square in the cache equals LlavaImageProcessor(do_pad=True)
    assert "LLaVA-1.5's training code" in caplog.text
    # a wrong padding colour: the wide and tall probe images differ from the processor's
    monkeypatch.setattr(adapter, "image_transform", dataclasses.replace(adapter.image_transform, fill=(0, 0, 0)))
    _fresh_check(monkeypatch)
    with pytest.raises(ProcessorMismatchError, match=r"model.family=llava .*'pixel_values'.*largest difference"):
        adapter._check_authority()


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen3_vl"])
def test_qwen_image_stage_is_checked_against_the_image_processor_at_start_up(model_type, monkeypatch):
    adapter = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": model_type}))
    _fresh_check(monkeypatch)
    adapter._check_authority()
    inputs = adapter.images.inputs

    def shifted_grid(paths):  # an image stage whose grids disagree with the processor's
        out = inputs(paths)
        return {**out, "image_grid_thw": out["image_grid_thw"].flip(-1)}

    monkeypatch.setattr(adapter.images, "inputs", shifted_grid)
    _fresh_check(monkeypatch)
    with pytest.raises(ProcessorMismatchError, match="'image_grid_thw'"):
        adapter._check_authority()


def test_the_check_runs_once_per_checkpoint(monkeypatch):
    calls = []
    _fresh_check(monkeypatch)
    monkeypatch.setattr(ProcessorAuthority, "_check_probe", lambda self, dialogue: calls.append(dialogue.id))
    build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_5_vl"}))
    build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_5_vl"}))
    assert calls == ["processor-probe"]

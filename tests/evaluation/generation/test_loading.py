"""A checkpoint never decides whether its own code runs."""

import json

import pytest

from mmtune.evaluation.generation.loading import RemoteCodeRefused, load_for_evaluation, resolve_checkpoint
from mmtune.models.config import ModelConfig


def _plant(directory, marker, *, saved_trust=True, auto_map=True):
    """A checkpoint whose config points at a module that leaves ``marker`` behind when imported."""
    directory.mkdir(parents=True)
    config = {"model_type": "planted_model", "architectures": ["PlantedModel"]}
    if auto_map:
        config["auto_map"] = {"AutoConfig": "planted.PlantedConfig", "AutoModelForImageTextToText": "planted.PlantedModel"}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"\0" * 16)
    (directory / "planted.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nraise SystemExit('planted code ran')\n"
    )
    (directory / "mmtune_run.json").write_text(
        json.dumps({"family": "auto", "config": {"model": {"family": "auto", "trust_remote_code": saved_trust}}})
    )
    return directory


def test_planted_auto_map_module_never_runs_when_user_disallows_remote_code(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    marker = tmp_path / "planted_code_ran"
    ckpt = _plant(tmp_path / "ckpt", marker)
    with pytest.raises(RemoteCodeRefused) as err:
        load_for_evaluation(str(ckpt), ModelConfig(family="auto", trust_remote_code=False), device="cpu")
    message = str(err.value)
    assert "auto_map" in message and "planted.PlantedConfig" in message
    assert "model.trust_remote_code=true" in message and "--trust-remote-code" in message
    assert not marker.exists()


def test_saved_run_setting_never_turns_remote_code_on(tmp_path):
    ckpt = _plant(tmp_path / "ckpt", tmp_path / "marker", auto_map=False)
    (ckpt / "planted.py").unlink()
    with pytest.raises(RemoteCodeRefused, match="saved with model.trust_remote_code=true"):
        resolve_checkpoint(str(ckpt), ModelConfig(family="auto", trust_remote_code=False))


def test_user_setting_wins_in_both_directions(tmp_path):
    ckpt = _plant(tmp_path / "ckpt", tmp_path / "marker", saved_trust=False, auto_map=False)
    (ckpt / "planted.py").unlink()
    resolved, _ = resolve_checkpoint(str(ckpt), ModelConfig(family="llava", trust_remote_code=True))
    assert resolved.trust_remote_code is True and resolved.family == "auto"
    resolved, _ = resolve_checkpoint(str(ckpt), ModelConfig(family="llava", trust_remote_code=False))
    assert resolved.trust_remote_code is False


def test_explicit_permission_lets_a_remote_code_checkpoint_through_resolution(tmp_path):
    ckpt = _plant(tmp_path / "ckpt", tmp_path / "marker")
    resolved, adapter = resolve_checkpoint(str(ckpt), ModelConfig(family="auto", trust_remote_code=True))
    assert resolved.trust_remote_code is True and adapter is None
    assert not (tmp_path / "marker").exists()  # resolution alone imports nothing


def test_lora_adapter_naming_a_remote_code_base_is_refused(tmp_path):
    base = _plant(tmp_path / "base", tmp_path / "marker", saved_trust=False)
    adapter = tmp_path / "run" / "final" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
    with pytest.raises(RemoteCodeRefused, match="auto_map"):
        resolve_checkpoint(str(adapter), ModelConfig(family="auto"))

"""Every YAML under configs/ composes through Hydra and validates against its typed schema.

- ``configs/<group>/<name>.yaml`` for a group of the SFT run (``model``, ``data``, ...,
  ``experiment``): composed into ``sft.yaml`` as ``<group>=<name>`` and turned into a
  validated :class:`~mmtune.training.config.SFTConfig`.
- a top-level ``configs/<name>.yaml``: composed as a primary config, after registering
  every schema the project ships (a primary config names its schema in ``defaults``).
"""

import importlib
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mmtune.training.config import SFTConfig, register_configs, to_sft_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SFT_GROUPS = {f.name for f in fields(SFTConfig)} | {"experiment"}
# Modules that register structured-config schemas for primary configs other than sft.yaml.
# Files that are only valid together with another choice (QLoRA quantizes a real checkpoint).
COMPANIONS = {"peft/qlora.yaml": ["model=llava_1_5_7b"]}
SCHEMA_MODULES = ("mmtune.training.config", "mmtune.evaluation.config", "mmtune.training.plan")


def _register_all() -> None:
    register_configs()
    for name in SCHEMA_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        for attr in ("register_configs", "register_schemas"):
            if hasattr(module, attr):
                getattr(module, attr)()


def _all_yaml() -> list[Path]:
    return sorted(p.relative_to(CONFIGS) for p in CONFIGS.rglob("*.yaml"))


def _in_sft_defaults(group: str) -> bool:
    defaults = OmegaConf.to_container(OmegaConf.load(CONFIGS / "sft.yaml")).get("defaults", [])
    return any(isinstance(d, dict) and any(k.split(" ")[-1] == group for k in d) for d in defaults)


@pytest.fixture(scope="module")
def hydra_context():
    _register_all()
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        yield


@pytest.mark.parametrize("relpath", _all_yaml(), ids=str)
def test_config_composes_and_validates(relpath: Path, hydra_context):
    if len(relpath.parts) == 1:
        cfg = compose(config_name=relpath.stem)
        if relpath.stem == "sft":
            to_sft_config(cfg)
        assert len(cfg) > 0
        return
    group = relpath.parts[0]
    name = str(relpath.with_suffix("").relative_to(group))
    if group == "build":  # `mmtune data build` configs: their own schema, loaded outside Hydra
        from mmtune.data.build.config import BuildConfig, load_build_config

        assert isinstance(load_build_config(str(CONFIGS / relpath)), BuildConfig)
        return
    if group not in SFT_GROUPS:
        pytest.fail(f"configs/{relpath}: group {group!r} is not part of any known schema; "
                    f"SFT groups are {sorted(SFT_GROUPS)}")
    override = f"{group}={name}" if _in_sft_defaults(group) else f"+{group}={name}"
    cfg = compose(config_name="sft", overrides=[override, *COMPANIONS.get(str(relpath), [])])
    config = to_sft_config(cfg)
    assert isinstance(config, SFTConfig)


def test_unknown_key_and_wrong_type_fail_at_start_up(hydra_context):
    from hydra.errors import ConfigCompositionException as HydraCompositionError

    with pytest.raises(HydraCompositionError, match="learning_rate"):
        compose(config_name="sft", overrides=["training.learning_rate=1e-4"])
    with pytest.raises(HydraCompositionError, match="training.epochs"):
        compose(config_name="sft", overrides=["training.epochs=many"])


def test_semantic_problems_are_collected_into_one_error(hydra_context):
    from mmtune.training.config import ConfigError

    cfg = compose(config_name="sft", overrides=["training.mixed_precision=fp8", "peft.method=dora",
                                                "training.gradient_accumulation_steps=0"])
    with pytest.raises(ConfigError) as info:
        to_sft_config(cfg)
    message = str(info.value)
    for key in ("training.mixed_precision", "peft.method", "training.gradient_accumulation_steps"):
        assert key in message


def test_xc2_official_presets_follow_the_official_finetune_scripts(hydra_context):
    full = to_sft_config(compose(config_name="sft", overrides=["training=xc2_official", "model=internlm_xc2_tiny"]))
    t = full.training
    assert (t.lr, t.weight_decay, t.adam_beta2, t.warmup_ratio, t.lr_scheduler, t.epochs) == (
        1e-5, 0.1, 0.95, 0.01, "cosine", 1)  # fmt: skip
    assert t.projector.train and not t.vision.train and t.mixed_precision == "bf16" and t.gradient_checkpointing
    lora = to_sft_config(compose(config_name="sft", overrides=[
        "training=xc2_official", "peft=lora_xc2_official", "model=internlm_xc2_tiny"]))  # fmt: skip
    assert (lora.peft.r, lora.peft.alpha, lora.peft.dropout) == (64, 64, 0.05)
    assert list(lora.peft.target_modules) == ["wqkv", "wo", "w1", "w2", "w3"]
    assert lora.training.lr == 5e-5 and not lora.training.projector.train and lora.training.weight_decay == 0.1


def test_plus_key_unknown_to_the_schema_is_rejected(hydra_context):
    from mmtune.training.config import ConfigError

    with pytest.raises(ConfigError, match=r"training\.lerning_rate"):
        to_sft_config(compose(config_name="sft", overrides=["+training.lerning_rate=1e-4"]))
    with pytest.raises(ConfigError, match=r"data\.mixture\.sources\[0\]\.imag_root \(did you mean data\.mixture\.sources\[0\]\.image_root\?\)"):
        to_sft_config(compose(config_name="sft", overrides=["+data.mixture.sources.0.imag_root=/x"]))
    # free-form dict fields still take any key
    cfg = to_sft_config(compose(config_name="sft", overrides=["+model.architecture.text_config.new_option=1"]))
    assert cfg.model.architecture["text_config"]["new_option"] == 1


def test_plus_key_unknown_to_the_evaluation_schema_is_rejected(hydra_context):
    from mmtune.evaluation.config import to_evaluate_config

    cfg = compose(config_name="evaluate", overrides=["eval.synthetic.data_path=x.json", "+eval.generation.max_new_token=3"])
    with pytest.raises(ValueError, match=r"eval\.generation\.max_new_token \(did you mean eval\.generation\.max_new_tokens\?\)"):
        to_evaluate_config(cfg)


def test_missing_model_path_names_the_key(tmp_path):
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    with pytest.raises(FileNotFoundError, match=r"model\.path='.*/no/such/ckpt' does not exist"):
        build_adapter(ModelConfig(family="llava", path=str(tmp_path / "no" / "such" / "ckpt")))
    not_a_dir = tmp_path / "weights.bin"
    not_a_dir.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"model\.path=.* is a file"):
        build_adapter(ModelConfig(family="llava", path=str(not_a_dir)))


def test_an_experiment_whose_launcher_starts_another_engine_is_refused():
    """One key chooses the engine: the experiment's `launcher` is checked against it when the config is
    validated (mmtune.training.launch.launcher_problem), so the two cannot disagree."""
    from mmtune.compose import compose_checked
    from mmtune.training.config import ConfigError, to_sft_config

    with pytest.raises(ConfigError, match=r"training.backend.engine=fsdp2 but launcher=launch/accelerate/"
                                          r"single_node_8gpu_zero3.yaml launches deepspeed .* set launcher= to a "
                                          r"launch file for training.backend.engine=fsdp2"):
        to_sft_config(compose_checked(["experiment=table3_llava15_7b_mmdu45k", "training.backend.engine=fsdp2"],
                                      "sft", command="test"))
    with pytest.raises(ConfigError, match=r"training.backend.deepspeed.stage=2 but launcher=.*zero3.yaml -> "
                                          r"launch/deepspeed/zero3.json launches ZeRO-3"):
        to_sft_config(compose_checked(["experiment=table3_llava15_7b_mmdu45k", "training.backend.deepspeed.stage=2"],
                                      "sft", command="test"))
    # the engine and its launcher named together: accepted
    to_sft_config(compose_checked(["experiment=table3_llava15_7b_mmdu45k", "training.backend.engine=fsdp2",
                                   "launcher=launch/accelerate/single_node_8gpu_fsdp2.yaml"], "sft", command="test"))


def test_evaluations_name_their_training_run_through_its_own_key(tmp_path, monkeypatch):
    """An experiment that reads a training run's final/ names it as ${mmtune.key_of:<experiment>,training.output_dir}:
    the training experiment's own key, so moving that run's output moves every reader with it."""
    import re

    from mmtune.compose import compose_checked, experiment_key
    from tests.support.experiments import declared_recipe

    monkeypatch.setenv("MMTUNE_OUTPUT_ROOT", str(tmp_path))
    readers = {}
    for path in sorted((CONFIGS / "experiment").glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        copied = re.search(r"^\s*path:[ \t]*(?![ \t]|\$\{mmtune\.key_of:).*/final\s*$", text, re.M)
        assert copied is None, f"{path.name} copies a training run's final/ path: {copied.group(0).strip()}"
        readers.update({path.stem: m for m in re.findall(r"\$\{mmtune\.key_of:([a-z0-9_]+),training\.output_dir\}",
                                                         text)})
    assert len(readers) == 8
    for reader, trained in readers.items():
        output_dir = to_sft_config(compose_checked([f"experiment={trained}"], "sft", command="test")).training.output_dir
        assert output_dir == str(tmp_path / trained) == experiment_key(trained, "training.output_dir")
        recipe = declared_recipe(reader)
        composed = compose_checked([f"experiment={reader}"], recipe, command="test")
        assert OmegaConf.select(composed, "model.path") == f"{output_dir}/final", reader

"""FSDP2 on 2 gloo ranks (torchrun, CPU) against one process and against DDP: the same losses and
final weights (full and LoRA merged, tiny LLaVA and Qwen2-VL), DDP's final/ (files, tensor names,
from_pretrained, the synthetic benchmark), the chunked loss's gradients, activation checkpointing
and packing, a text-only micro-batch on one rank beside images on the other, SIGKILL of one rank
and resume on two ranks and on one; and the start-up refusals of the engine (fast)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.processes import REPO, SFT, read_jsonl, run_ok as _run, torchrun as _torchrun
from tests.support.processes import assert_same_weights as _assert_same_weights, child_env as _env
from tests.support.processes import final_weights as _weights, free_port, step_sample_ids

FAMILIES = {"llava": (), "qwen2_vl": ("model=qwen2_vl_tiny",)}
PEFT = {"full": (), "lora": ("peft=lora", "peft.dropout=0.0")}  # no dropout: the ranks' RNG streams differ


def _losses(run: Path) -> list[float]:
    return [m["train/loss"] for m in read_jsonl(run / "metrics.jsonl")]


def _adapter_weights(final: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(final / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("peft", PEFT)
@pytest.mark.parametrize("family", FAMILIES)
def test_two_fsdp2_ranks_match_one_process(family, peft, tmp_path, synthetic_dir, tiny_overrides):
    """Same global batch (2 ranks x 1 micro-batch against 1 process x 2): same losses and weights at 1e-5."""
    common = (*FAMILIES[family], *PEFT[peft], "training.max_steps=4", "training.lr=2e-4",
              "training.log_sample_ids=true")
    sharded, single = tmp_path / "fsdp2", tmp_path / "one"
    out = _run([*_torchrun(2), *tiny_overrides(sharded, synthetic_dir, *common, "training.backend.engine=fsdp2")])
    assert "engine: FSDP2 (fully_shard units: decoder_layers, vision_tower" in out
    _run([sys.executable, SFT, *tiny_overrides(single, synthetic_dir, *common, "training.gradient_accumulation_steps=2")])

    # The same samples in each step: rank r of the sharded run took the step's r-th micro-batch.
    ids = [[i for r in s["ranks"] for mb in r["ids"] for i in mb] for s in read_jsonl(sharded / "sample_ids.jsonl")]
    assert ids == [[i for r in s["ranks"] for mb in r["ids"] for i in mb]
                   for s in read_jsonl(single / "sample_ids.jsonl")]
    assert len(_losses(sharded)) == 4
    assert _losses(sharded) == pytest.approx(_losses(single), rel=1e-5)
    # final/ is the full model (LoRA merged into it), as one process writes it.
    _assert_same_weights(_weights(sharded / "final", family), _weights(single / "final", family))
    if peft == "lora":
        _assert_same_weights(_adapter_weights(sharded / "final"), _adapter_weights(single / "final"))
        assert "merged" not in json.loads((sharded / "final" / "mmtune_run.json").read_text())


def _files(final: Path) -> list[str]:
    return sorted(str(p.relative_to(final)) for p in final.rglob("*") if p.is_file())


def _saved_tensors(final: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(final / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("family,peft", [("llava", "full"), ("qwen2_vl", "full"), ("llava", "lora")])
def test_fsdp2_final_is_the_checkpoint_ddp_writes_and_it_loads_and_evaluates(family, peft, tmp_path, synthetic_dir,
                                                                             tiny_overrides):
    """2 ranks each: FSDP2's final/ has DDP's files, tensor names and weights (LoRA merged), loads
    with the family's from_pretrained and runs the synthetic benchmark."""
    from mmtune.evaluation.config import EvalConfig, GenerationConfig
    from mmtune.evaluation.runner import evaluate_checkpoint

    common = (*FAMILIES[family], *PEFT[peft], "training.max_steps=2", "training.lr=2e-4")
    finals = {}
    for engine in ("fsdp2", "ddp"):
        _run([*_torchrun(2), *tiny_overrides(tmp_path / engine, synthetic_dir, *common,
                                             f"training.backend.engine={engine}")])
        finals[engine] = tmp_path / engine / "final"
    sharded, replicated = finals["fsdp2"], finals["ddp"]
    assert _files(sharded) == _files(replicated) and "model.safetensors" in _files(sharded)
    if peft == "lora":
        assert "adapter/adapter_model.safetensors" in _files(sharded)
    saved, reference = _saved_tensors(sharded), _saved_tensors(replicated)
    assert saved.keys() == reference.keys()
    _assert_same_weights(saved, reference)
    loaded = _weights(sharded, family)  # the family's XForConditionalGeneration.from_pretrained
    _assert_same_weights(loaded, _weights(replicated, family))
    if peft == "lora":  # merged as DDP merges, not left adapter-only
        assert "merged" not in json.loads((sharded / "mmtune_run.json").read_text())
        assert not any("lora_" in n for n in saved)

    cfg = EvalConfig(benchmarks=["synthetic"], progress=False,
                     generation=GenerationConfig(max_new_tokens=4, batch_size=2, device="cpu"))
    cfg.synthetic.data_path = str(synthetic_dir / "test.json")
    cfg.synthetic.image_root = str(synthetic_dir / "images")
    results = evaluate_checkpoint(str(sharded), cfg, output_dir=str(tmp_path / "eval"), run_name=family)
    assert results["synthetic"].counts["missing"] == 0
    rows = (tmp_path / "eval" / "generations" / "synthetic.jsonl").read_text().splitlines()
    assert rows and all(json.loads(r)["answer"] is not None for r in rows)


@pytest.mark.slow
def test_a_text_only_rank_beside_an_image_rank_completes_the_step(tmp_path, synthetic_dir, tiny_overrides):
    """The vision tower runs on the text-only rank too (a zero-weighted dummy image inside the
    forward, where images would go), so the ranks' gathers line up, also under the chunked
    linear cross-entropy; the result is one process's."""
    records = json.loads((synthetic_dir / "llava.json").read_text())
    records += [{"id": f"text-{i}", "conversations": [{"from": "human", "value": f"Say {i} please"},
                                                       {"from": "gpt", "value": f"{i} then"}]} for i in range(8)]
    data = tmp_path / "mixed.json"
    data.write_text(json.dumps(records))
    common = ("synthetic.enabled=false", "data.mixture.sources.0.format=llava", f"data.mixture.sources.0.path={data}",
              f"data.mixture.sources.0.image_root={synthetic_dir / 'images'}", "collator.batch_size=1",
              "training.max_steps=6", "training.lr=2e-4", "training.log_sample_ids=true", "training.vision.train=true")
    sharded, single = tmp_path / "fsdp2", tmp_path / "one"
    out = _run([*_torchrun(2), *tiny_overrides(sharded, synthetic_dir, *common, "training.backend.engine=fsdp2",
                                               "training.loss_impl=chunked")])
    # The linear cross-entropy, not a fallback: its loss joins the model's outputs, so FSDP2's root
    # unit starts its backward at the same point on the text-only rank as on the image rank.
    assert "loss: chunked linear cross-entropy" in out and "fallback" not in out
    _run([sys.executable, SFT, *tiny_overrides(single, synthetic_dir, *common, "training.gradient_accumulation_steps=2")])
    mixed_steps = [s for s in read_jsonl(sharded / "sample_ids.jsonl")
                   if sorted(r["ids"][0][0].startswith("text-") for r in s["ranks"]) == [False, True]]
    assert mixed_steps, "no step had a text-only rank beside an image rank; the test data does not exercise it"
    assert _losses(sharded) == pytest.approx(_losses(single), rel=1e-5)
    _assert_same_weights(_weights(sharded / "final", "llava"), _weights(single / "final", "llava"))


def _kill_one_rank_after_checkpoint(cmd: list[str], out: Path, step: int) -> None:
    """Start ``cmd`` (torchrun, 2 ranks); SIGKILL rank 1 once ``checkpoints/step-<step>`` is complete
    and a later step is logged; torchrun then stops the other rank."""
    import psutil

    launcher = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    deadline, killed = time.time() + 600, False
    while time.time() < deadline and launcher.poll() is None and not killed:
        done = (out / "checkpoints" / f"step-{step}" / "trainer_state.json").is_file()
        if done and any(m["step"] > step for m in read_jsonl(out / "metrics.jsonl")):
            for child in psutil.Process(launcher.pid).children():
                if "LOCAL_RANK" in child.environ() and child.environ()["LOCAL_RANK"] == "1":
                    child.send_signal(signal.SIGKILL)
                    killed = True
        time.sleep(0.01)
    output = launcher.communicate(timeout=300)[0]
    assert killed and launcher.returncode != 0, "the run ended before a rank could be killed:\n" + output[-3000:]


@pytest.mark.slow
def test_sigkill_of_one_rank_then_resume_on_two_ranks_or_on_one_matches_the_uninterrupted_run(tmp_path, synthetic_dir,
                                                                                              tiny_overrides):
    """torch.distributed.checkpoint reshards model and optimizer on load, and the data position moves onto
    one rank with twice the accumulation (the same 2 micro-batches per step): both resumes end with the
    uninterrupted 2-rank run's weights and log its losses."""
    import shutil

    common = ("training.epochs=2", "training.max_steps=6", "training.save_every_steps=2", "training.resume=auto",
              "training.lr=2e-4", "training.backend.engine=fsdp2", "training.log_sample_ids=true")
    reference, killed, on_one = tmp_path / "reference", tmp_path / "killed", tmp_path / "on_one"
    _run([*_torchrun(2), *tiny_overrides(reference, synthetic_dir, *common)])
    _kill_one_rank_after_checkpoint([*_torchrun(2), *tiny_overrides(killed, synthetic_dir, *common)], killed, 2)
    assert (killed / "checkpoints" / "step-2" / "sharded" / ".metadata").is_file()  # torch.distributed.checkpoint
    shutil.copytree(killed, on_one)
    # One process with one micro-batch per step would group the samples otherwise: refused before
    # anything loads, naming the accumulation that keeps the global batch.
    one = subprocess.run([*_torchrun(1), *tiny_overrides(on_one, synthetic_dir, *common)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=900)
    said = one.stdout + one.stderr
    assert one.returncode != 0 and "it was saved on 2 ranks x training.gradient_accumulation_steps=1" in said, said[-3000:]
    assert "Set training.gradient_accumulation_steps=2 to keep 2 micro-batches per step on 1 rank" in said
    out_one = _run([*_torchrun(1), *tiny_overrides(on_one, synthetic_dir, *common,
                                                   "training.gradient_accumulation_steps=2")])
    assert "resuming on 1 rank(s) x 2 micro-batch(es) per step, saved on 2 x 1" in out_one
    assert "processes 0..0 restored their own; those of processes 1..1 are not used" in out_one
    out_two = _run([*_torchrun(2), *tiny_overrides(killed, synthetic_dir, *common)])
    assert "resumed from" in out_two
    expected = read_jsonl(reference / "metrics.jsonl")
    for run, out, rel in ((killed, out_two, 1e-6), (on_one, out_one, 1e-5)):
        resumed_at = int(out.split("resumed from ")[1].split("step ")[1].split(",")[0])
        logged = read_jsonl(run / "metrics.jsonl")
        assert [m["step"] for m in logged] == [m["step"] for m in expected] == [1, 2, 3, 4, 5, 6]
        after = [m for m in logged if m["step"] > resumed_at]
        assert after, f"{run.name} resumed at step {resumed_at}, after the last one"
        for key in ("train/loss", "train/grad_norm", "train/lr", "train/loss_tokens", "train/epoch"):
            assert [m[key] for m in after] == pytest.approx([m[key] for m in expected[resumed_at:]], rel=rel), key
        assert step_sample_ids(run) == step_sample_ids(reference)
        _assert_same_weights(_weights(run / "final", "llava"), _weights(reference / "final", "llava"))


@pytest.mark.slow
@pytest.mark.parametrize("setting", [("training.gradient_checkpointing=true",),
                                     ("collator.batching=packing", "collator.packing_window=256",
                                      "training.epochs=2")], ids=["activation_checkpointing", "packing"])
def test_activation_checkpointing_and_packing_under_fsdp2_match_one_process(setting, tmp_path, synthetic_dir,
                                                                           tiny_overrides):
    """Recomputed activations inside the sharded decoder layers, and packed rows, on 2 FSDP2
    ranks: the same losses and final weights as one process over the same batches, at 1e-5."""
    common = ("training.max_steps=3", "training.lr=2e-4", *setting)
    sharded, single = tmp_path / "fsdp2", tmp_path / "one"
    _run([*_torchrun(2), *tiny_overrides(sharded, synthetic_dir, *common, "training.backend.engine=fsdp2")])
    _run([sys.executable, SFT, *tiny_overrides(single, synthetic_dir, *common, "training.gradient_accumulation_steps=2")])
    assert len(_losses(sharded)) >= 2
    assert _losses(sharded) == pytest.approx(_losses(single), rel=1e-5)
    _assert_same_weights(_weights(sharded / "final", "llava"), _weights(single / "final", "llava"))


def _first_gradient(tmp_path: Path, name: str, cmd: list[str], overrides: list[str]) -> tuple[dict, str]:
    """The first optimizer step's (gathered) gradients, saved by dist_worker.py, and the run's output."""
    proc = subprocess.run([*cmd, str(REPO / "tests" / "training" / "dist_worker.py"), str(tmp_path / f"{name}{{rank}}.json"),
                           *overrides], cwd=REPO, env={**_env(), "GRADS_OUT": str(tmp_path / f"{name}-grads{{rank}}.pt")},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return torch.load(tmp_path / f"{name}-grads0.pt"), proc.stdout + proc.stderr


@pytest.mark.slow
def test_the_chunked_loss_runs_under_fsdp2_with_the_materialised_gradients(tmp_path, synthetic_dir, tiny_overrides):
    """training.loss_impl=chunked and materialized on 2 FSDP2 ranks give the same first-step
    gradients at 1e-5, equal to one process's (chunked) over the same batch."""
    common = ("training.max_steps=1", "training.loss_chunk_size=16")
    grads, outputs = {}, {}
    for impl in ("chunked", "materialized"):
        grads[impl], outputs[impl] = _first_gradient(
            tmp_path, impl, [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             str(free_port())],
            tiny_overrides(tmp_path / impl, synthetic_dir, *common, f"training.loss_impl={impl}",
                           "training.backend.engine=fsdp2"))
    grads["one"], _ = _first_gradient(tmp_path, "one", [sys.executable],
                                      tiny_overrides(tmp_path / "one", synthetic_dir, *common,
                                                     "training.loss_impl=chunked",
                                                     "training.gradient_accumulation_steps=2"))
    assert "loss: chunked linear cross-entropy" in outputs["chunked"] and "fallback" not in outputs["chunked"]
    assert grads["chunked"].keys() == grads["materialized"].keys() == grads["one"].keys()
    head = next(n for n in grads["chunked"] if n.endswith("lm_head.weight"))
    assert grads["chunked"][head].abs().max() > 0
    for name, grad in grads["materialized"].items():
        torch.testing.assert_close(grads["chunked"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(grads["one"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    losses = {run: _losses(tmp_path / run) for run in ("chunked", "materialized", "one")}
    assert losses["chunked"] == pytest.approx(losses["materialized"], rel=1e-5)
    assert losses["chunked"] == pytest.approx(losses["one"], rel=1e-5)


# -- start-up refusals (fast) ---------------------------------------------------------------------


def _config(*overrides: str):
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config

    return to_sft_config(compose_sft_config(["experiment=demo_single_image", *overrides]))


def test_an_unknown_sharding_unit_is_refused_at_start_up_naming_the_key():
    from mmtune.training.config import ConfigError

    with pytest.raises(ConfigError, match=r"training.backend.fsdp2.units: 'decoder' unknown; use any of "
                                          r"decoder_layers, vision_layers, vision_tower"):
        _config("training.backend.engine=fsdp2", "training.backend.fsdp2.units=[decoder]")


def test_a_unit_the_model_does_not_have_is_refused_naming_the_key_and_what_it_has():
    from mmtune.models.base import ModuleGroups
    from mmtune.training.config import run_engine

    engine = run_engine(_config("training.backend.engine=fsdp2", "training.backend.fsdp2.units=[vision_layers]"))
    engine.accelerator = SimpleNamespace(device=torch.device("cpu"), num_processes=1)
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    groups = ModuleGroups(vision=[torch.nn.Linear(4, 4)], projector=[], language_model=[layers])
    with pytest.raises(ValueError, match=r"training.backend.fsdp2.units names vision_layers, which this model does "
                                         r"not have; it has decoder_layers, vision_tower"):
        engine.shard(torch.nn.Sequential(layers), groups)


def test_a_launch_for_another_engine_is_refused_with_both_names(monkeypatch):
    from mmtune.training.config import run_engine
    from mmtune.training.engines import EngineLaunchError

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch` with a DeepSpeed config sets
    engine = run_engine(_config("training.backend.engine=fsdp2"))
    with pytest.raises(EngineLaunchError, match=r"training.backend.engine=fsdp2 but the launcher started this "
                                                r"process for deepspeed.*or set training.backend.engine=deepspeed"):
        engine.start(SimpleNamespace())


def test_a_deepspeed_file_whose_stage_disagrees_is_refused_with_both_values():
    from mmtune.training.config import ConfigError

    with pytest.raises(ConfigError, match=r"training.backend.deepspeed.stage=2 but .*zero3.json has 3"):
        _config("training.backend.engine=deepspeed", "training.backend.deepspeed.stage=2",
                f"training.backend.deepspeed.config_file={REPO}/launch/deepspeed/zero3.json")


def test_an_engine_whose_package_is_missing_is_refused_at_start_up(monkeypatch):
    import importlib.util

    from mmtune.training.config import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError, match=r"training.backend.engine=deepspeed needs the 'deepspeed' package"):
        _config("training.backend.engine=deepspeed")


@pytest.mark.parametrize("overrides, refused", [
    (("training.backend.engine=fsdp2",), "training.backend.engine=fsdp2 shards the model over a process group"),
    (("training.sequence_parallel.size=2",), "training.sequence_parallel.size=2 does not divide the 1 launched"),
    (("training.backend.engine=fsdp2", "training.sequence_parallel.size=2"),
     "training.backend.engine=fsdp2 shards the model over a process group, which a plain `python` start does not "
     "create; training.sequence_parallel.size=2 does not divide"),
])
def test_a_launch_the_engine_cannot_run_is_refused_before_the_model_loads_with_the_command(
        overrides, refused, tmp_path, synthetic_dir, tiny_overrides, monkeypatch):
    from mmtune.models.llava import LlavaAdapter
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.engines import EngineLaunchError
    from mmtune.training.loop import SFTRecipe

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LlavaAdapter, "load_model", never)
    recipe = SFTRecipe(to_sft_config(compose_sft_config(tiny_overrides(tmp_path / "run", synthetic_dir, *overrides))))
    with pytest.raises(EngineLaunchError) as info:
        recipe.setup()
    assert refused in str(info.value)
    assert "Launch it with 2 processes (or a multiple of 2): torchrun --nproc_per_node 2 -m mmtune train" in str(info.value)


def test_sequence_parallel_heads_are_checked_from_the_config_on_the_meta_device():
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter
    from mmtune.training.plan.model import meta_model
    from mmtune.training.sequence_parallel.groups import planned_head_problems

    model_cfg = ModelConfig(family="llava")
    adapter = build_adapter(model_cfg)
    text = adapter.text_config(meta_model(model_cfg)[0].config)
    heads, kv_heads = int(text.num_attention_heads), int(text.num_key_value_heads)

    assert planned_head_problems(model_cfg, adapter, kv_heads) == []  # divides both (kv_heads divides heads)
    size = heads + 1
    assert planned_head_problems(model_cfg, adapter, size) == [
        f"the language model's {count} {name} do not divide by training.sequence_parallel.size={size}"
        for name, count in (("attention heads", heads), ("key/value heads", kv_heads)) if count % size]

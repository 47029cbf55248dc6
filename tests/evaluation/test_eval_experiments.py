"""Every evaluation experiment under configs/experiment/ runs to the end.

Each experiment is composed exactly as ``python recipes/evaluate.py +experiment=<name>``
would compose it, then run through the runner with tiny random-weight models of the same
family standing in for the 7B weights, small benchmark files at the configured paths, a
loopback judge, and a recorder in place of the lmms-eval process (lmms-eval is an
optional extra). Everything else is the real code path: schema, start-up checks, the
generator, judging, official files, the lmms-eval command and the report.
"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image as PILImage

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.benchmarks import lmms_eval
from mmtune.evaluation.config import register_configs, to_evaluate_config
from mmtune.evaluation.generation.generator import DialogueGenerator
from mmtune.evaluation.runner import evaluate_checkpoint
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.support.experiments import experiments
from tests.support.fake_judge import FakeJudgeServer, Scripted

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = experiments("evaluate")  # their typed `recipe` key
#: one experiment per kind runs in the default suite; the others with the slow tests
FAST = {"table3_xc2", "table3_llava15_7b_mmdu45k_eval", "table5_baseline_2k", "tiny_table5_long_eval_2x"}
TINY = {"llava": "llava_tiny", "internlm_xcomposer2": "internlm_xc2_tiny"}
MMDU_REPLY = ("The answer is fine.\n{'Creativity': 6, 'Richness': 6, 'Visual Perception': 7, 'Logical Coherence': 7, "
              "'Answer Accuracy': 5, 'Image Relationship Understanding': 6, 'Overall Score': 6}")


def test_every_table_has_its_eval_experiments():
    assert len(EXPERIMENTS) >= 15
    assert {"table3_llava15_7b", "table3_xc2", "table5_baseline_2k", "table5_mmdu45k_eval_8k"} <= set(EXPERIMENTS)


def _image(path: Path, colour) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    PILImage.new("RGB", (64, 48), colour).save(path)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    data, outputs = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("outputs")
    _image(data / "mmdu" / "mmdu_pics" / "a.jpg", (200, 0, 0))
    _image(data / "mmdu" / "mmdu_pics" / "b.jpg", (0, 0, 200))
    (data / "mmdu" / "benchmark.json").write_text(json.dumps([{
        "id": "d0", "image": ["/mmdu_pics/a.jpg", "/mmdu_pics/b.jpg"],
        "conversations": [
            {"from": "user", "value": "Image1: <ImageHere>. Image2: <ImageHere>. Compare the colours."},
            {"from": "assistant", "value": "Image1 is red and Image2 is blue."},
            {"from": "user", "value": "Which one is warmer?"},
            {"from": "assistant", "value": "Image1."},
        ],
    }]))
    for k in range(3):
        _image(data / "mm-vet" / "images" / f"v1_{k}.png", (40 * k, 90, 90))
    (data / "mm-vet" / "mm-vet.json").write_text(json.dumps({
        f"v1_{k}": {"imagename": f"v1_{k}.png", "question": f"What is shown {k}?", "answer": "a square<OR>a box",
                    "capability": [["rec"], ["ocr", "spat"], ["rec", "know"]][k]} for k in range(3)
    }))
    generate_synthetic(outputs / "tiny_table5_data", n_train=0, n_test=2, n_llava=0, image_size=56, max_turns=2)
    return data, outputs


@pytest.fixture(scope="module")
def tiny_models():
    built = {}

    def get(family):
        if family not in built:
            yaml = ROOT / "configs" / "model" / f"{TINY[family]}.yaml"
            cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(yaml)))
            adapter = build_adapter(cfg)
            built[family] = (adapter, adapter.load_model(seed=0).eval())
        return built[family]

    return get


def _judge(body):
    content = body["messages"][-1]["content"]
    text = content if isinstance(content, str) else content[0]["text"]
    return Scripted("0.6" if "Correctness" in text else MMDU_REPLY)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in EXPERIMENTS])
def test_eval_experiment_dry_runs(name, roots, tiny_models, tmp_path, monkeypatch):
    data, outputs = roots
    monkeypatch.setenv("MMTUNE_DATA_ROOT", str(data))
    monkeypatch.setenv("MMTUNE_OUTPUT_ROOT", str(outputs))
    monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", "sk-dry-run")
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("evaluate", overrides=[f"+experiment={name}", f"output_dir={tmp_path / 'out'}"])
    config = to_evaluate_config(cfg)
    ev = config.eval
    # small and fast; every other setting is the experiment's own
    ev.progress = False
    ev.generation.max_new_tokens, ev.generation.device = 3, "cpu"
    for section in (ev.mmdu, ev.mmvet, ev.synthetic, ev.mdi):
        section.limit = 2

    monkeypatch.setattr(lmms_eval, "lmms_eval_installed", lambda: True)
    commands = []

    def record_lmms_eval(command, check):
        commands.append(command)
        out = Path(command[command.index("--output_path") + 1])
        tasks = command[command.index("--tasks") + 1].split(",")
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_results.json").write_text(json.dumps({"results": {t: {"score,none": 0.5} for t in tasks}}))

    adapter, model = tiny_models(config.model.family)
    with FakeJudgeServer(_judge) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        results = evaluate_checkpoint(
            config.checkpoint, ev, output_dir=config.output_dir, run_name=config.run_name, model_config=config.model,
            command_runner=record_lmms_eval, make_generator=lambda: DialogueGenerator(adapter, model, ev.generation),
        )
    out = Path(config.output_dir)
    expected = [b for b in ev.benchmarks if b != "lmms_eval"] + (list(ev.lmms_eval.tasks) if "lmms_eval" in ev.benchmarks else [])
    assert sorted(results) == sorted(expected) and (out / "report.md").exists()
    for bench in ("synthetic", "mmdu", "mmvet"):
        if bench in results:  # the model answered every question
            assert results[bench].counts["missing"] == 0, results[bench].counts
    if "mmdu" in results:
        assert results["mmdu"].counts["valid"] == results["mmdu"].counts["turns"] == 2
        # the one-token check of the judge before generation is not an MMDU call
        mmdu_calls = [b for b in server.requests if "Correctness" not in json.dumps(b["messages"]) and b["max_tokens"] > 1]
        assert {b["model"] for b in mmdu_calls} == {ev.judge.model}
        assert all(isinstance(b["messages"][-1]["content"], list) for b in mmdu_calls)  # images attached
    if "mmvet" in results:
        assert results["mmvet"].counts["valid"] == 2 * ev.mmvet.runs
        vet_calls = [b for b in server.requests if "Correctness" in json.dumps(b["messages"])]
        assert {b["model"] for b in vet_calls} == {"gpt-4-0613"} and {b["max_tokens"] for b in vet_calls} == {3}
        assert all(isinstance(b["messages"][-1]["content"], str) for b in vet_calls)  # text only
        assert (out / f"{results['mmvet'].model.strip('/').replace('/', '_')}_gpt-4-0613-cap-int-score-5runs.csv").exists() \
            or any(out.glob("*gpt-4-0613-cap-int-score-5runs.csv"))
    if "lmms_eval" in ev.benchmarks:
        (command,) = commands
        model_args = command[command.index("--model_args") + 1]
        # baseline rows evaluate the released base model; fine-tuned rows their own final/
        assert f"pretrained={config.model.path}" in model_args
        if name in ("table3_llava15_7b", "table3_xc2"):
            assert not config.model.path.startswith(str(outputs))
        else:
            assert config.model.path.startswith(str(outputs))
        if config.model.family == "internlm_xcomposer2":
            assert command[2] == "mmtune.evaluation.lmms_model" and "family=internlm_xcomposer2" in model_args
            assert json.loads(Path(model_args.split("model_config=")[1]).read_text())["family"] == "internlm_xcomposer2"
        else:
            assert command[2] == "lmms_eval" and command[command.index("--model") + 1] == "llava_hf"


def test_lmms_eval_missing_refuses_at_start_up(tmp_path, monkeypatch):
    """Without lmms-eval and without recorded results, a Table 3 run stops before any model or judge work."""
    from mmtune.evaluation.config import EvalConfig

    monkeypatch.setattr(lmms_eval, "lmms_eval_installed", lambda: False)
    cfg = EvalConfig(benchmarks=["synthetic", "lmms_eval"])
    cfg.synthetic.data_path = "unused.json"
    called = []
    with pytest.raises(ValueError, match="lmms-eval is not installed"):
        evaluate_checkpoint(None, cfg, output_dir=str(tmp_path), make_generator=lambda: called.append(1))
    assert not called


def test_adapter_checkpoint_with_hf_wrapper_refuses_at_start_up(tmp_path, monkeypatch):
    from mmtune.evaluation.benchmarks.base import RunContext
    from mmtune.evaluation.config import EvalConfig
    from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalBenchmark

    monkeypatch.setattr(lmms_eval, "lmms_eval_installed", lambda: True)
    cfg = EvalConfig(benchmarks=["lmms_eval"])
    ctx = RunContext(cfg, tmp_path, None, run="r", model="m", checkpoint="/runs/x/final/adapter", family="llava",
                     lmms_pretrained="/runs/x/final/adapter", lmms_is_adapter=True)
    (problem,) = LmmsEvalBenchmark().preflight(ctx)
    assert "LoRA adapter" in problem and "model_type=mmtune" in problem
    cfg.lmms_eval.model_type = "mmtune"
    assert LmmsEvalBenchmark().preflight(ctx) == []

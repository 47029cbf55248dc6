"""The qwen2_vl family through evaluation: MMDU, MM-Vet, MDI and the synthetic benchmark run to
the end with a saved tiny Qwen2.5-VL checkpoint (loopback judge), and lmms-eval (0.7.3, run
in a process of its own as in test_lmms_model.py) evaluates it through the lmms-eval model
``mmtune``, its replies equal to mmtune's own generator's answers."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image as PILImage

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalConfig, build_command
from mmtune.evaluation.config import EvalConfig, GenerationConfig, JudgeConfig
from mmtune.evaluation.runner import evaluate_checkpoint
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.support.fake_judge import FakeJudgeServer, Scripted

MMDU_REPLY = ("Fine.\n{'Creativity': 6, 'Richness': 6, 'Visual Perception': 7, 'Logical Coherence': 7, "
              "'Answer Accuracy': 5, 'Image Relationship Understanding': 6, 'Overall Score': 6}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen2.5-VL saved as mmtune's final/ would be."""
    root = tmp_path_factory.mktemp("qwen_ckpt") / "final"
    adapter = build_adapter(ModelConfig(family="qwen2_vl", architecture={"model_type": "qwen2_5_vl"}))
    adapter.load_model().save_pretrained(root)
    adapter.save_pretrained(str(root))
    (root / "mmtune_run.json").write_text(json.dumps({"family": "qwen2_vl", "run": "tiny",
                                                      "config": {"model": {"family": "qwen2_vl", "path": None}}}))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_bench")
    for name, size in (("a.jpg", (96, 64)), ("b.jpg", (40, 150))):
        (root / "mmdu" / "pics").mkdir(parents=True, exist_ok=True)
        PILImage.effect_noise(size, 50).convert("RGB").save(root / "mmdu" / "pics" / name)
    (root / "mmdu" / "benchmark.json").write_text(json.dumps([{
        "id": "m0", "image": ["/pics/a.jpg", "/pics/b.jpg"],
        "conversations": [
            {"from": "user", "value": "Image1: <ImageHere>. Image2: <ImageHere>. Compare them."},
            {"from": "assistant", "value": "Image1 is wide, Image2 is tall."},
            {"from": "user", "value": "Which one is taller?"},
            {"from": "assistant", "value": "Image2."},
        ],
    }]))
    (root / "mm-vet" / "images").mkdir(parents=True)
    for k in range(2):
        PILImage.effect_noise((50 + 30 * k, 60), 40).convert("RGB").save(root / "mm-vet" / "images" / f"v1_{k}.png")
    (root / "mm-vet" / "mm-vet.json").write_text(json.dumps({
        f"v1_{k}": {"imagename": f"v1_{k}.png", "question": f"What is shown {k}?", "answer": "noise",
                    "capability": ["rec"]} for k in range(2)}))
    (root / "mdi" / "images").mkdir(parents=True)
    for k in range(2):
        PILImage.effect_noise((70, 40 + 20 * k), 40).convert("RGB").save(root / "mdi" / "images" / f"{k}.png")
    (root / "mdi" / "mdi.json").write_text(json.dumps([
        {"question number": k, "key": f"level{k + 1}-sport-old", "image_path": str(k), "question": "How many?",
         "option": "A.1; B.2; C.3", "answer": "B"} for k in range(2)]))
    synthetic = generate_synthetic(root / "syn", n_train=0, n_test=2, n_llava=0, image_size=56, max_turns=2)
    return root, synthetic


def test_mmdu_mmvet_mdi_and_synthetic_run_with_the_family(checkpoint, data, tmp_path, monkeypatch):
    root, synthetic = data
    cfg = EvalConfig(benchmarks=["synthetic", "mmdu", "mmvet", "mdi"], progress=False,
                     generation=GenerationConfig(max_new_tokens=4, batch_size=2, device="cpu"),
                     judge=JudgeConfig(model="judge-model"))
    cfg.synthetic.data_path, cfg.synthetic.image_root = str(synthetic.test_json), str(synthetic.image_dir)
    cfg.mmdu.data_path, cfg.mmdu.image_root = str(root / "mmdu" / "benchmark.json"), str(root / "mmdu")
    cfg.mmvet.data_path, cfg.mmvet.image_root = str(root / "mm-vet" / "mm-vet.json"), str(root / "mm-vet" / "images")
    cfg.mmvet.runs = 1
    cfg.mdi.data_path, cfg.mdi.image_root = str(root / "mdi" / "mdi.json"), str(root / "mdi" / "images")
    monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", "sk-test")

    def judge(body):
        text = json.dumps(body["messages"])
        return Scripted("0.5" if "Correctness" in text else MMDU_REPLY)

    with FakeJudgeServer(judge) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        results = evaluate_checkpoint(str(checkpoint), cfg, output_dir=str(tmp_path / "eval"), run_name="qwen")
    assert sorted(results) == ["mdi", "mmdu", "mmvet", "synthetic"]
    assert results["mmdu"].counts["valid"] == results["mmdu"].counts["turns"] == 2
    assert results["mmvet"].counts["valid"] == 2
    for name in ("synthetic", "mmdu", "mmvet"):
        assert results[name].counts["missing"] == 0, (name, results[name].counts)
    generations = {name: [json.loads(line) for line in (tmp_path / "eval" / "generations" / f"{name}.jsonl")
                          .read_text().splitlines()] for name in ("synthetic", "mmdu", "mmvet", "mdi")}
    assert all(r["answer"] is not None and r["prompt_tokens"] > 0 for rows in generations.values() for r in rows)
    # MMDU's second turn carries both images (their grids) and the model's own first answer
    assert generations["mmdu"][1]["prompt_tokens"] > generations["mmdu"][0]["prompt_tokens"]
    assert (tmp_path / "eval" / "report.md").exists()


@pytest.mark.skipif(importlib.util.find_spec("lmms_eval") is None,
                    reason="lmms-eval is an optional extra: pip install --no-deps lmms-eval==0.7.3 && "
                    "pip install -e '.[lmms-eval-runtime]' (as .ci/run does)")
def test_lmms_eval_evaluates_the_family_through_the_mmtune_model(checkpoint, tmp_path):
    from mmtune.evaluation.generation.loading import load_for_evaluation
    from tests.support.lmms_tasks import own_answers, worker_env, write_task

    adapter, model, _ = load_for_evaluation(str(checkpoint), ModelConfig(family="qwen2_vl"), device="cpu")
    assert adapter.family == "qwen2_vl" and adapter.model_type == "qwen2_5_vl"
    _, docs = write_task(tmp_path / "probe", "probe", ["-"] * 3)
    own = own_answers(adapter, model, docs)
    # the references are the model's own answers: lmms-eval's replies must score 1.0
    task_dir, _ = write_task(tmp_path / "qwen", "qwen_tiny", own, until="NEVER-SEEN")
    spec = {"runs": [{"name": "qwen", "task_dir": str(task_dir), "task": "qwen_tiny",
                      "model_args": f"pretrained={checkpoint},family=qwen2_vl,device=cpu"}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    worker = Path(__file__).with_name("lmms_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path / "spec.json"), str(tmp_path / "report.json")],
                          cwd=tmp_path, env=worker_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())["qwen"]
    assert report["model"] == "mmtune" and report["replies"] == own
    assert report["results"]["exact_match,none"] == 1.0
    # the runner hands lmms-eval this family through the mmtune model, with its model config
    command = build_command(str(checkpoint), LmmsEvalConfig(tasks=["mmstar"]), family="qwen2_vl", output_path="/o",
                            python=sys.executable, model_config_file="/o/mmtune_model.json")
    assert command[2] == "mmtune.evaluation.lmms_model" and command[command.index("--model") + 1] == "mmtune"
    assert "family=qwen2_vl" in command[command.index("--model_args") + 1]

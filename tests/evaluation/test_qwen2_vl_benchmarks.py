"""The qwen2_vl family through evaluation: MMDU, MM-Vet, MDI and the synthetic benchmark run to
the end with a saved tiny Qwen2.5-VL checkpoint (loopback judge), and the lmms-eval model
``mmtune`` serves it (checked against a stand-in of lmms-eval's documented API)."""

import dataclasses
import json
import sys

import pytest
from PIL import Image as PILImage

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalConfig, build_command
from mmtune.evaluation.config import EvalConfig, GenerationConfig, JudgeConfig
from mmtune.evaluation.runner import evaluate_checkpoint
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.evaluation.test_lmms_model import Request, fake_lmms_eval  # noqa: F401 (a fixture)
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


def test_the_lmms_eval_model_serves_the_family(fake_lmms_eval, checkpoint):  # noqa: F811
    from mmtune.evaluation import lmms_model

    lmms_model.register()
    cls = fake_lmms_eval.MODEL_REGISTRY_V2.get_model_class("mmtune")
    model = cls(pretrained=str(checkpoint), family="qwen2_vl", device="cpu")
    assert model.engine.adapter.family == "qwen2_vl" and model.engine.adapter.model_type == "qwen2_5_vl"
    wide, tall = PILImage.new("RGB", (120, 40), (200, 30, 30)), PILImage.new("RGB", (30, 90), (20, 30, 200))
    model.task_dict = {"mmstar": {"val": {0: {"images": [wide]}, 1: {"images": [wide, tall]}}}}
    visual = lambda doc: doc["images"]  # noqa: E731
    replies = model.generate_until([
        Request(("<image>\nWhat colour is it?", {"max_new_tokens": 4, "temperature": 0}, visual, 0, "mmstar", "val")),
        Request(("Compare the two.", {"max_new_tokens": 4}, visual, 1, "mmstar", "val")),
    ])
    assert len(replies) == 2 and all(isinstance(r, str) for r in replies)
    # the runner hands lmms-eval this family through the mmtune model, with its model config
    command = build_command(str(checkpoint), LmmsEvalConfig(tasks=["mmstar"]), family="qwen2_vl", output_path="/o",
                            python=sys.executable, model_config_file="/o/mmtune_model.json")
    assert command[2] == "mmtune.evaluation.lmms_model" and command[command.index("--model") + 1] == "mmtune"
    assert "family=qwen2_vl" in command[command.index("--model_args") + 1]
    assert dataclasses.is_dataclass(model.engine.adapter.config)

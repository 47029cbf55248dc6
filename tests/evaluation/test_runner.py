import json

import pytest
import torch

from mmtune.data.synthetic import generate_synthetic
from mmtune.evaluation.config import EvalConfig, GenerationConfig, JudgeConfig
from tests.support.fake_judge import FakeJudgeServer, Scripted
from mmtune.evaluation.results import read_result
from mmtune.evaluation.runner import evaluate_checkpoint
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return generate_synthetic(tmp_path_factory.mktemp("syn"), n_train=0, n_test=3, n_llava=0, image_size=56, max_turns=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaVA saved as mmtune's final/ would be, plus a LoRA adapter of it."""
    root = tmp_path_factory.mktemp("ckpt")
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0)
    full = root / "final"
    model.save_pretrained(full)
    adapter.save_pretrained(str(full))
    (full / "mmtune_run.json").write_text(json.dumps({"family": "llava", "run": "tiny", "config": {"model": {"family": "llava", "path": None}}}))
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], exclude_modules=adapter.lora_exclude_modules))
    with torch.no_grad():  # non-zero LoRA weights, so merging changes the model
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    lora = root / "lora_run" / "final" / "adapter"
    peft_model.save_pretrained(lora)
    (lora.parent / "mmtune_run.json").write_text(json.dumps({"family": "llava", "config": {"model": {"family": "llava", "path": str(full)}}}))
    merged = peft_model.merge_and_unload()
    return {"full": full, "lora": lora, "merged_model": merged, "adapter": adapter}


def _cfg(data, **generation):
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False, generation=GenerationConfig(max_new_tokens=8, **generation))
    cfg.synthetic.data_path = str(data.test_json)
    cfg.synthetic.image_root = str(data.image_dir)
    return cfg


def test_synthetic_end_to_end_on_saved_checkpoint(data, saved, tmp_path):
    out = tmp_path / "eval"
    results = evaluate_checkpoint(str(saved["full"].parent), _cfg(data), output_dir=str(out), run_name="demo")
    result = read_result(out / "synthetic.json")
    assert result.metrics == results["synthetic"].metrics and result.run == "demo"
    assert 0.0 <= result.metrics["exact_match"] <= 100.0
    turns = [json.loads(l) for l in (out / "generations" / "synthetic.jsonl").read_text().splitlines()]
    assert result.counts["turns"] == len(turns) and result.counts["missing"] == 0
    details = [json.loads(l) for l in (out / "details" / "synthetic.jsonl").read_text().splitlines()]
    # the score is recomputable from the per-turn details
    assert result.metrics["exact_match"] == pytest.approx(100 * sum(d["correct"] for d in details) / len(details))
    report = (out / "report.md").read_text()
    assert "## synthetic" in report and (out / "synthetic_by_turn.png").stat().st_size > 1000
    # a second call resumes: nothing is generated again
    again = evaluate_checkpoint(str(saved["full"]), _cfg(data), output_dir=str(out), run_name="demo")
    assert again["synthetic"].metrics == result.metrics


def test_lora_adapter_dir_is_merged_and_equals_merged_model(data, saved, tmp_path):
    from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues
    from mmtune.evaluation.generation.generator import DialogueGenerator

    out = tmp_path / "eval"
    evaluate_checkpoint(str(saved["lora"]), _cfg(data), output_dir=str(out), run_name="lora")
    # batched generation writes each turn when it is done, so the file is in completion order
    lines = [json.loads(l) for l in (out / "generations" / "synthetic.jsonl").read_text().splitlines()]
    dialogues = load_mmdu_dialogues(data.test_json, image_root=str(data.image_dir))
    direct = DialogueGenerator(saved["adapter"], saved["merged_model"], GenerationConfig(max_new_tokens=8)).generate(dialogues)
    order = {(r.dialogue_id, r.turn): i for i, r in enumerate(direct)}
    from_dir = [r["answer"] for r in sorted(lines, key=lambda r: order[(r["dialogue_id"], r["turn"])])]
    assert len(lines) == len(direct) and from_dir == [r.answer for r in direct]
    base_adapter = build_adapter(ModelConfig(family="llava", path=str(saved["full"])))
    base = DialogueGenerator(base_adapter, base_adapter.load_model(), GenerationConfig(max_new_tokens=8)).generate(dialogues)
    assert from_dir != [r.answer for r in base], "the LoRA weights must change the answers"


def test_mmdu_generate_then_judge_with_local_server(data, saved, tmp_path, monkeypatch):
    reply = '{"Creativity": 4, "Richness": 4, "Visual Perception": 4, "Logical Coherence": 4, "Answer Accuracy": 4, "Image Relationship Understanding": 4, "Overall Score": 5}'
    with FakeJudgeServer(lambda body: Scripted("Reasoning.\n" + reply)) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", "sk-never-in-files")
        cfg = EvalConfig(benchmarks=["mmdu"], progress=False, generation=GenerationConfig(max_new_tokens=6),
                         judge=JudgeConfig(model="judge-m", send_images=True))
        cfg.mmdu.data_path, cfg.mmdu.image_root = str(data.test_json), str(data.image_dir)
        out = tmp_path / "eval"
        results = evaluate_checkpoint(str(saved["full"]), cfg, output_dir=str(out), run_name="r")
        check, *judged = server.requests  # the judge is checked with one token before generation starts
        assert check["max_tokens"] == 1 and all(b["max_tokens"] > 1 for b in judged)
        calls = len(judged)
        # images of the dialogue travel with each judge call when send_images is on
        assert any(isinstance(b["messages"][-1]["content"], list) for b in judged)
        evaluate_checkpoint(str(saved["full"]), cfg, output_dir=str(out), run_name="r")
        # resume: generation and judging both cached; only the one-token check again
        assert len(server.requests) == 1 + calls + 1 and server.requests[-1]["max_tokens"] == 1
    result = results["mmdu"]
    assert result.metrics["Overall"] == pytest.approx(50.0) and result.metrics["C"] == pytest.approx(40.0)
    assert result.counts["turns"] == calls and result.meta["judge_stats"]["completed"] == calls
    written = "".join(p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".md", ".csv"))
    assert "sk-never-in-files" not in written and server.base_url not in written


def test_wandb_logging_gets_metrics_and_plots_but_no_secrets(data, saved, tmp_path, monkeypatch):
    import wandb

    logged, inits = [], []

    class StubRun:
        def log(self, values):
            logged.append(values)

        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kw: (inits.append(kw), StubRun())[1])
    monkeypatch.setattr(wandb, "Image", lambda path: ("image", path))
    monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", "sk-wandb-secret")
    evaluate_checkpoint(str(saved["full"]), _cfg(data), output_dir=str(tmp_path), run_name="w", wandb=True, wandb_project="p")
    assert inits[0]["project"] == "p" and inits[0]["name"] == "w"
    assert "sk-wandb-secret" not in repr(inits) and "sk-wandb-secret" not in repr(logged)
    values = logged[0]
    assert "eval/synthetic/exact_match" in values and values["eval/plots/synthetic_by_turn"][0] == "image"


def test_evaluate_model_in_memory_with_peft_wrapper_restores_training_mode(data, tmp_path):
    from peft import LoraConfig, get_peft_model

    from mmtune.evaluation.runner import evaluate_model

    adapter = build_adapter(ModelConfig(family="llava"))
    model = get_peft_model(adapter.load_model(seed=0), LoraConfig(r=2, target_modules=["q_proj"], exclude_modules=adapter.lora_exclude_modules))
    model.train()
    results = evaluate_model(model, adapter, _cfg(data), output_dir=str(tmp_path), run_name="mid", model_label="step-10")
    assert model.training and results["synthetic"].model == "step-10" and results["synthetic"].counts["missing"] == 0

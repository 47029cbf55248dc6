from pathlib import Path

import pytest

from mmtune.evaluation.benchmarks.lmms_eval import LmmsEvalConfig
from mmtune.evaluation.benchmarks.lmms_eval import build_command, find_results_file, parse_results
from mmtune.evaluation.results import read_result, write_result

FIXTURE = Path(__file__).parents[1] / "fixtures" / "lmms_eval_results.json"


def test_command_for_llava_checkpoint():
    cfg = LmmsEvalConfig(tasks=["mmmu_val", "ai2d"], batch_size=2, extra_args=["--limit", "8"])
    cmd = build_command("/runs/x/final", cfg, family="llava", output_path="/tmp/o", python="python")
    assert cmd == ["python", "-m", "lmms_eval", "--model", "llava_hf", "--model_args", "pretrained=/runs/x/final",
                   "--tasks", "mmmu_val,ai2d", "--batch_size", "2", "--output_path", "/tmp/o", "--log_samples", "--limit", "8"]


def test_unknown_family_needs_model_type():
    with pytest.raises(ValueError, match="eval.lmms_eval.model_type"):
        build_command("/c", LmmsEvalConfig(), family="auto", output_path="/o")
    cmd = build_command("/c", LmmsEvalConfig(model_type="xcomposer2d5"), family="internlm_xcomposer2", output_path="/o")
    assert cmd[cmd.index("--model") + 1] == "xcomposer2d5"


def test_parse_recorded_results(tmp_path):
    results = {r.benchmark: r for r in parse_results(FIXTURE, run="r", model="m")}
    assert set(results) == {"mmmu_val", "ai2d", "chartqa"}
    assert results["mmmu_val"].metrics == {"mmmu_acc": pytest.approx(0.35667), "score": pytest.approx(35.667)}
    ai2d = results["ai2d"]
    assert ai2d.metrics["exact_match/flexible-extract"] == pytest.approx(0.5528)
    assert ai2d.metrics["score"] == pytest.approx(55.21) and ai2d.counts == {"original": 3088, "effective": 3088}
    assert ai2d.meta["stderr"] == {"exact_match_stderr/flexible-extract": pytest.approx(0.00894)}
    assert results["chartqa"].metrics["score"] == pytest.approx(18.12)
    # round trip through mmtune's result files
    path = write_result(ai2d, tmp_path)
    assert read_result(path).metrics == ai2d.metrics


def test_parse_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"tasks \['mmstar'\] are not in the results"):
        parse_results(FIXTURE, run="r", model="m", tasks=["mmstar"])
    bad = tmp_path / "x.json"
    bad.write_text('{"foo": 1}')
    with pytest.raises(ValueError, match="not an lmms-eval results file"):
        parse_results(bad, run="r", model="m")


def test_find_results_file(tmp_path):
    target = tmp_path / "llava_hf" / "20261129_results.json"
    target.parent.mkdir()
    target.write_text(FIXTURE.read_text())
    (tmp_path / "llava_hf" / "samples_ai2d.jsonl").write_text("")
    assert find_results_file(str(tmp_path)) == target


def test_run_hands_off_and_collects(tmp_path, monkeypatch):
    """A stand-in ``lmms_eval`` package records its argv and writes the recorded results file."""
    from mmtune.evaluation.benchmarks.lmms_eval import run_lmms_eval

    package = tmp_path / "fake" / "lmms_eval"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import json, pathlib, sys\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--output_path') + 1]) / 'llava_hf'\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        f"(out / '20261129_results.json').write_text(pathlib.Path({str(FIXTURE)!r}).read_text())\n"
        "(out.parent / 'argv.json').write_text(json.dumps(sys.argv[1:]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    cfg = LmmsEvalConfig(tasks=["ai2d", "chartqa"])
    results = run_lmms_eval("/ckpt/final", cfg, family="llava", output_path=str(tmp_path / "o"), run="r", model="m")
    assert [r.benchmark for r in results] == ["ai2d", "chartqa"]
    import json

    argv = json.loads((tmp_path / "o" / "argv.json").read_text())
    assert argv[:6] == ["--model", "llava_hf", "--model_args", "pretrained=/ckpt/final", "--tasks", "ai2d,chartqa"]


def test_missing_lmms_eval_says_what_to_do(monkeypatch, tmp_path):
    import importlib.util

    from mmtune.evaluation.benchmarks.lmms_eval import run_lmms_eval

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"mmtune\[lmms-eval\].*results_path"):
        run_lmms_eval("/c", LmmsEvalConfig(), family="llava", output_path=str(tmp_path), run="r", model="m")


def test_launcher_command_for_xcomposer2():
    cmd = build_command("/runs/xc2/final", LmmsEvalConfig(tasks=["mmstar"]), family="internlm_xcomposer2",
                        output_path="/o", python="python", model_config_file="/o/mmtune_model.json")
    assert cmd[:5] == ["python", "-m", "mmtune.evaluation.lmms_model", "--model", "mmtune"]
    assert cmd[cmd.index("--model_args") + 1] == "pretrained=/runs/xc2/final,family=internlm_xcomposer2,model_config=/o/mmtune_model.json"

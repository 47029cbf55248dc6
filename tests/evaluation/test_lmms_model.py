"""mmtune's generator as lmms-eval's model ``mmtune``, run by lmms-eval itself (0.7.3, installed
without its own requirements: ``pip install --no-deps lmms-eval==0.7.3`` plus the
``lmms-eval-runtime`` extra) on local tasks: a task YAML, a JSON-lines file and images
written by the test, no hub. lmms-eval finds the model through mmtune's entry point,
builds its requests, calls ``generate_until`` and scores the replies; the replies must be
mmtune's own generator's answers to the same questions. lmms-eval runs in a process of its
own (lmms_worker.py): evaluating changes process-wide state that later tests would see."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.support.lmms_tasks import COLOURS, own_answers, worker_env, write_task

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lmms_eval") is None,
    reason="lmms-eval is an optional extra: pip install --no-deps lmms-eval==0.7.3 && "
    "pip install -e '.[lmms-eval-runtime]' (as .ci/run does)")

ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def llava_final(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmms")
    adapter = build_adapter(ModelConfig(family="llava"))
    model = adapter.load_model(seed=0)
    model.save_pretrained(root / "final")
    adapter.save_pretrained(str(root / "final"))
    (root / "final" / "mmtune_run.json").write_text(json.dumps({"family": "llava", "run": "tiny"}))
    return root / "final", adapter, model


def _tiny_xc2():
    yaml = ROOT / "configs" / "model" / "internlm_xc2_tiny.yaml"
    tiny = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig()), OmegaConf.load(yaml)))
    adapter = build_adapter(tiny)
    return adapter, adapter.load_model(seed=0).eval()


@pytest.mark.slow  # the default suite runs lmms-eval through the mmtune model in test_lmms_model_auto.py
def test_lmms_eval_runs_the_mmtune_model_through_its_entry_point_and_evaluator(llava_final, tmp_path):
    final, adapter, model = llava_final
    _, docs = write_task(tmp_path / "probe", "probe", list(COLOURS))
    own = own_answers(adapter, model, docs)
    xc2_own = own_answers(*_tiny_xc2(), docs)
    # the reference of the first item is the model's own answer, so the score is exactly 1/3
    llava_dir, _ = write_task(tmp_path / "llava", "mmtune_tiny", [own[0], "not-an-answer", "not-an-answer"])
    xc2_dir, _ = write_task(tmp_path / "xc2", "xc2_tiny", xc2_own, until="NEVER-SEEN")
    choice_dir, _ = write_task(tmp_path / "mc", "xc2_choice", list(COLOURS), output_type="multiple_choice")
    spec = {"runs": [
        {"name": "llava", "task_dir": str(llava_dir), "task": "mmtune_tiny",
         "model_args": f"pretrained={final},family=llava,device=cpu"},
        {"name": "xc2", "task_dir": str(xc2_dir), "task": "xc2_tiny", "model_args": None},
        {"name": "choice", "task_dir": str(choice_dir), "task": "xc2_choice", "model_args": None},
    ]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("lmms_worker.py")), str(tmp_path / "spec.json"),
                           str(tmp_path / "report.json")], cwd=tmp_path, env=worker_env(tmp_path), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())

    # LLaVA from a saved final/, found through mmtune's `lmms_eval.models` entry point
    assert report["llava"]["model"] == "mmtune"
    assert report["llava"]["replies"] == [a.split("\n\n")[0] for a in own]  # `until` cuts at its first stop string
    assert report["llava"]["results"]["exact_match,none"] == pytest.approx(1 / 3)
    # InternLM-XComposer2 as a model object handed to the evaluator
    assert report["xc2"]["replies"] == xc2_own and report["xc2"]["results"]["exact_match,none"] == 1.0
    # a log-likelihood task is refused with what to use instead
    assert "generation tasks only" in report["choice"]["error"]


@pytest.mark.slow
def test_the_runner_hands_off_to_lmms_evals_command_line_and_reads_its_results(llava_final, tmp_path):
    """eval.lmms_eval with model_type mmtune: mmtune's launcher, lmms-eval's CLI in a
    subprocess, its results JSON parsed into an mmtune result."""
    final, adapter, model = llava_final
    _, docs = write_task(tmp_path / "probe", "probe", list(COLOURS))
    own = own_answers(adapter, model, docs)
    task_dir, _ = write_task(tmp_path / "task", "mmtune_cli", [own[0], own[1], "not-an-answer"])
    code = f"""
import sys
from mmtune.evaluation.config import EvalConfig
from mmtune.evaluation.runner import evaluate_checkpoint
cfg = EvalConfig(benchmarks=["lmms_eval"], progress=False)
cfg.lmms_eval.tasks = ["mmtune_cli"]
cfg.lmms_eval.model_type = "mmtune"
cfg.lmms_eval.extra_args = ["--include_path", {str(task_dir)!r}]
results = evaluate_checkpoint({str(final)!r}, cfg, output_dir={str(tmp_path / "out")!r}, run_name="r")
print("SCORE", results["mmtune_cli"].metrics["exact_match"])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=worker_env(tmp_path), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SCORE 0.666" in proc.stdout
    assert "mmtune.evaluation.lmms_model --model mmtune" in proc.stdout  # the command it ran
    result = json.loads((tmp_path / "out" / "mmtune_cli.json").read_text())
    assert result["meta"]["source"] == "lmms-eval" and result["metrics"]["exact_match"] == pytest.approx(2 / 3)

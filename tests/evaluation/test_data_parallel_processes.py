"""Data-parallel evaluation in real processes on CPU (torchrun, gloo): two ranks give the
generations and scores of one process, judge each answer once, and a failing rank fails the
whole command with its error and merges nothing. Slow: each process imports the stack."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fake_judge import FakeJudgeServer, Scripted
from tests.support.processes import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
REPLY = json.dumps({"Creativity": 6, "Richness": 5, "Visual Perception": 7, "Logical Coherence": 6,
                    "Answer Accuracy": 4, "Image Relationship Understanding": 5, "Overall Score": 5})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaVA saved as mmtune's final/, and a held-out split of 5 dialogues."""
    from mmtune.data.synthetic import generate_synthetic
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    root = tmp_path_factory.mktemp("dp")
    adapter = build_adapter(ModelConfig(family="llava"))
    adapter.load_model(seed=0).save_pretrained(root / "final")
    adapter.save_pretrained(str(root / "final"))
    (root / "final" / "mmtune_run.json").write_text(json.dumps({"family": "llava", "run": "tiny"}))
    data = generate_synthetic(root / "syn", n_train=0, n_test=5, n_llava=0, image_size=56, max_turns=3, seed=1)
    return root / "final", data


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return env


def _recipe(saved, out, processes, **env):
    final, data = saved
    overrides = [f"checkpoint={final}", "eval=synthetic", "eval.benchmarks=[synthetic,mmdu]",
                 f"eval.synthetic.data_path={data.test_json}", f"eval.synthetic.image_root={data.image_dir}",
                 f"eval.mmdu.data_path={data.test_json}", f"eval.mmdu.image_root={data.image_dir}",
                 "eval.judge.model=fake-judge", "eval.generation.max_new_tokens=6", "eval.generation.batch_size=2",
                 "eval.progress=false", f"output_dir={out}"]
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
        "--master_port", str(free_port())]
    proc = subprocess.run([*launcher, str(REPO / "recipes" / "evaluate.py"), *overrides], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_two_ranks_give_the_generations_and_scores_of_one_process_and_judge_each_answer_once(saved, tmp_path):
    with FakeJudgeServer(lambda body: Scripted(REPLY), max_requests=200, lifetime_s=900) as server:
        env = {"MMTUNE_JUDGE_BASE_URL": server.base_url}
        _recipe(saved, tmp_path / "two", 2, **env)
        # the one-token check before generation (judge.check_first) is no judgement
        judged_by_two = sum(body.get("max_tokens") != 1 for body in server.requests)
        _recipe(saved, tmp_path / "one", 1, **env)
    for name in ("synthetic", "mmdu"):
        two = (tmp_path / "two" / "generations" / f"{name}.jsonl").read_text()
        one = (tmp_path / "one" / "generations" / f"{name}.jsonl").read_text()
        assert two == one and two
        results = [json.loads((tmp_path / run / f"{name}.json").read_text()) for run in ("two", "one")]
        assert results[0]["metrics"] == results[1]["metrics"] and results[0]["counts"] == results[1]["counts"]
        details = [(tmp_path / run / "details" / f"{name}.jsonl").read_text() for run in ("two", "one")]
        assert details[0] == details[1]
        ranks = results[0]["meta"]["data_parallel"]
        assert ranks["processes"] == 2 and [r["rank"] for r in ranks["ranks"]] == [0, 1]
        assert all(r["dialogues"] > 0 for r in ranks["ranks"]) and "data_parallel" not in results[1]["meta"]
    turns = len((tmp_path / "two" / "generations" / "mmdu.jsonl").read_text().splitlines())
    assert judged_by_two == turns  # rank 0 alone judged, every answer once
    assert not list((tmp_path / "two" / "generations").glob("*.rank*"))
    assert (tmp_path / "two" / "report.md").is_file() and (tmp_path / "two" / "viewer.html").is_file()


def test_cli_processes_relaunches_itself_and_a_failing_rank_fails_the_command(saved, tmp_path):
    final, data = saved
    args = [sys.executable, "-m", "mmtune.cli", "evaluate", "checkpoint", str(final), "synthetic", "--data",
            str(data.test_json), "--image-root", str(data.image_dir), "--max-new-tokens", "6", "--batch-size", "2",
            "--quiet"]
    ok = subprocess.run([*args, "--out", str(tmp_path / "two"), "--processes", "2"], cwd=REPO, env=_env(),
                        capture_output=True, text=True, timeout=900)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    assert "launching 2 processes" in ok.stderr and ok.stdout.count("synthetic: {") == 1  # rank 0 prints the scores
    one = subprocess.run([*args, "--out", str(tmp_path / "one")], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert one.returncode == 0, one.stderr[-3000:]
    assert (tmp_path / "two" / "generations" / "synthetic.jsonl").read_text() == \
        (tmp_path / "one" / "generations" / "synthetic.jsonl").read_text()

    # rank 1 cannot write its share: both ranks stop with rank 1's error, nothing is merged
    bad = tmp_path / "bad"
    (bad / "generations" / "synthetic.rank1-of-2.jsonl").mkdir(parents=True)
    failed = subprocess.run([*args, "--out", str(bad), "--processes", "2"], cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=900)
    assert failed.returncode != 0
    assert failed.stderr.count("rank 1 of 2 failed while generating synthetic") >= 2, failed.stderr[-4000:]
    assert "IsADirectoryError" in failed.stderr
    assert not (bad / "generations" / "synthetic.jsonl").exists() and not (bad / "synthetic.json").exists()

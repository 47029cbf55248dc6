"""``mmtune data build`` end to end: the demo config on a generated corpus with the loopback
teacher, then ``mmtune data check --strict`` on the result and a short SFT run on it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmtune.cli import main as mmtune

REPO = Path(__file__).resolve().parents[3]


def _build(monkeypatch, teacher, corpus, out, *extra):
    for k, v in teacher.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MMTUNE_TEACHER_API_KEY", "sk-secret-test-key")
    return mmtune(["data", "build", "demo", f"corpus.path={corpus}", f"output.dir={out}", "embed.kind=hashing",
                   "--no-progress", *extra])


def test_demo_build_passes_strict_data_check(monkeypatch, teacher, corpus, tmp_path, capsys):
    out = tmp_path / "built"
    assert _build(monkeypatch, teacher, corpus, out) == 0
    printed = capsys.readouterr().out
    assert "3 clusters" in printed and "problems none" in printed
    assert "sk-secret-test-key" not in printed
    assert all(r["auth"] == "Bearer sk-secret-test-key" for r in teacher.requests)
    assert not any("sk-secret-test-key" in p.read_text(errors="ignore")
                   for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl", ".md", ".yaml"))
    assert mmtune(["data", "check", str(out / "data.yaml"), "--strict", "--cache-dir", str(tmp_path / "c")]) == 0
    assert "records  read" in capsys.readouterr().out


def test_config_and_build_errors_have_exit_codes(monkeypatch, teacher, corpus, tmp_path, capsys):
    assert mmtune(["data", "build", "demo", "cluster.nope=1"]) == 2
    assert "nope" in capsys.readouterr().err
    monkeypatch.delenv("MMTUNE_TEACHER_MODEL", raising=False)
    assert mmtune(["data", "build", "demo", f"corpus.path={corpus}", f"output.dir={tmp_path / 'o'}",
                   "embed.kind=hashing", "--no-progress"]) == 1
    assert "MMTUNE_TEACHER_MODEL" in capsys.readouterr().err
    assert _build(monkeypatch, teacher, corpus, tmp_path / "o", "--shard", "3/2") == 1
    assert "0 <= i < n" in capsys.readouterr().err


def test_plan_shards_and_merge_stages(monkeypatch, teacher, corpus, tmp_path, capsys):
    out = tmp_path / "built"
    assert _build(monkeypatch, teacher, corpus, out, "--stage", "plan") == 0
    assert teacher.requests == []
    for i in range(2):
        assert _build(monkeypatch, teacher, corpus, out, "--stage", "generate", "--shard", f"{i}/2") == 0
    assert not (out / "mmdu.json").exists()
    assert _build(monkeypatch, teacher, corpus, out, "--stage", "merge", "--shards", "2") == 0
    assert json.loads((out / "stats.json").read_text())["sets_unfinished"] == 0


def test_built_dataset_trains_through_the_sft_recipe(monkeypatch, teacher, corpus, tmp_path):
    out = tmp_path / "built"
    assert _build(monkeypatch, teacher, corpus, out) == 0
    run = tmp_path / "run"
    source = (f"data.mixture.sources=[{{name:built,format:mmdu,path:'{out / 'mmdu.json'}',"
              f"image_root:'{out / 'images'}'}}]")
    overrides = [
        "experiment=demo", "synthetic.enabled=false", source, f"training.output_dir={run}",
        "training.max_steps=3", "training.eval_before=false", "training.eval_after=false",
        "logging.progress_bar=false", "collator.batch_size=4", "collator.max_length=2048",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sft.py"), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["train/loss"] > 0 and m["train/loss_tokens"] > 0 for m in metrics)


@pytest.mark.slow
def test_a_killed_build_resumes_without_repeating_cached_calls(teacher, corpus, tmp_path):
    import signal
    import sqlite3
    import time

    from mmtune.data.build.config import load_build_config
    from mmtune.data.build.pipeline import load_or_make_plan

    teacher.latency_s = 0.05
    out = tmp_path / "built"
    args = ["data", "build", "demo", f"corpus.path={corpus}", f"output.dir={out}", "embed.kind=hashing",
            "teacher.concurrency=2", "--no-progress"]
    env = {**os.environ, **teacher.env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "mmtune.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = out / "shards" / "0-of-1" / "dialogues.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoint.is_file() and checkpoint.read_text().count("\n") >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the build finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with sqlite3.connect(out / "shards" / "0-of-1" / "teacher_cache.sqlite") as db:
        cached = db.execute("SELECT COUNT(*) FROM replies").fetchone()[0]
    cfg = load_build_config("demo", [f"corpus.path={corpus}", f"output.dir={out}", "embed.kind=hashing"])
    plan = load_or_make_plan(cfg)
    needed = sum(len(s.images) * (cfg.prompts.per_image_pairs > 0) + 1 for s in plan.sets)
    assert 0 < cached < needed
    served = teacher.served
    rc = subprocess.run([sys.executable, "-m", "mmtune.cli", *args], cwd=REPO, env=env, capture_output=True,
                        text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr[-2000:]
    # only calls never answered are made, and the teacher's one-token check before the build
    assert teacher.served - served == needed - cached + 1
    assert len(json.loads((out / "mmdu.json").read_text())) == len(plan.sets)


def test_a_build_without_a_reachable_teacher_stops_before_embedding_anything(monkeypatch, corpus, tmp_path, capsys):
    import socket

    def no_embedding(*args, **kwargs):
        raise AssertionError("the corpus was embedded before the teacher was checked")

    monkeypatch.setattr("mmtune.data.build.pipeline.build_embedder", no_embedding)
    monkeypatch.delenv("MMTUNE_TEACHER_MODEL", raising=False)
    args = ["data", "build", "demo", f"corpus.path={corpus}", f"output.dir={tmp_path / 'o'}", "--no-progress"]
    assert mmtune(args) == 1
    err = capsys.readouterr().err
    assert "no teacher configured: set teacher.model in the build config or $MMTUNE_TEACHER_MODEL" in err
    assert "$MMTUNE_TEACHER_BASE_URL" in err and "A local teacher" in err and "Nothing was embedded" in err
    with socket.socket() as probe:  # a local server that is not running
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MMTUNE_TEACHER_MODEL", "local-vlm")
    monkeypatch.setenv("MMTUNE_TEACHER_BASE_URL", f"http://127.0.0.1:{port}/v1")
    assert mmtune(args) == 1
    err = capsys.readouterr().err
    assert "failed a one-token test request" in err and "connection refused" in err and "$MMTUNE_TEACHER_BASE_URL" in err
    assert not (tmp_path / "o" / "plan").exists()


def test_the_console_lists_skipped_entries_and_no_http_request_lines(monkeypatch, teacher, corpus, tmp_path, capsys,
                                                                     caplog):
    import logging

    lines = corpus.read_text().splitlines()
    bad = corpus.with_name("with_bad.jsonl")
    bad.write_text("\n".join(lines + ['{"id": "no-images", "captions": ["x"]}', "not json"]) + "\n")
    caplog.set_level(logging.INFO)
    assert _build(monkeypatch, teacher, bad, tmp_path / "built", "--no-progress") == 0
    out = capsys.readouterr().out
    assert "teacher: model 'fake-teacher' at http://127.0.0.1" in out
    assert "skipped 2; images kept" in out and "skipped malformed_entry" in out and "skipped invalid_json" in out
    assert "e.g. line" in out  # where each skipped entry is
    assert teacher.requests and not [r for r in caplog.records if r.name in ("httpx", "httpcore", "openai")]

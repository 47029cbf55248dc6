"""The ``api`` generation backend against a loopback model server that checks every request:
the history holds the model's own answers and every image so far, decoding is as configured,
failed and empty turns are recorded per turn, resumed, and fail the run above the allowed share."""

import json
import random

import pytest
from PIL import Image as PILImage

from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues
from mmtune.evaluation.config import EvalConfig, GenerationConfig
from mmtune.evaluation.config import ApiGenerationConfig
from mmtune.evaluation.generation.api import ApiGenerator
from mmtune.evaluation.generation.records import GenerationFailures, StaleGenerationsError, read_generations
from mmtune.evaluation.runner import evaluate_checkpoint
from tests.support.fake_judge import Scripted
from tests.support.fake_model import CheckingModel, default_answer

KEY = "sk-gen-SECRET-91b2"
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]


def _benchmark(root, n=5, seed=0, big=None):
    """An MMDU-schema file of ``n`` dialogues, 1-4 turns each, images in some turns (two in
    one), questions naming earlier images; the references are what the fake model answers."""
    rng = random.Random(seed)
    (root / "img").mkdir(parents=True, exist_ok=True)
    records = []
    for d in range(n):
        images, conversations, shown = [], [], 0
        for t in range(rng.randint(1, 4)):
            take = 2 if t == 1 else int(rng.random() < 0.5 or t == 0)
            marks = []
            for _ in range(take):
                shown += 1
                name = f"img/{d}-{shown}.png"
                size = big if big and shown == 1 else (40 + 8 * shown, 32)
                PILImage.new("RGB", size, COLOURS[(d + shown) % len(COLOURS)]).save(root / name)
                images.append(name)
                marks.append(f"Image{shown}: <ImageHere>")
            question = (f"dialogue {d}: describe Image{shown}." if t == 0
                        else f"Compare Image1 and Image{max(shown, 1)} (turn {t}).")
            conversations += [{"from": "user", "value": " ".join(marks + [question])},
                              {"from": "assistant", "value": default_answer(f"d{d}", t)}]
        records.append({"id": f"d{d}", "image": images, "conversations": conversations})
    path = root / "bench.json"
    path.write_text(json.dumps(records))
    return path, load_mmdu_dialogues(path, image_root=str(root), source="synthetic")


def _cfg(data, root, **api):
    settings = {"model": "gpt-4o-2024-05-13", "concurrency": 3, "backoff_base_s": 0.001, "backoff_max_s": 0.002,
                "timeout_s": 5.0, **api}
    gen = GenerationConfig(max_new_tokens=16, backend="api", api=ApiGenerationConfig(**settings))
    cfg = EvalConfig(benchmarks=["synthetic"], progress=False, generation=gen)
    cfg.synthetic.data_path, cfg.synthetic.image_root = str(data), str(root)
    return cfg


@pytest.fixture
def env(monkeypatch):
    def point_at(server):
        monkeypatch.setenv("MMTUNE_GEN_BASE_URL", server.base_url)
        monkeypatch.setenv("MMTUNE_GEN_API_KEY", KEY)
    return point_at


def _turns(dialogues):
    return [(d.id, t) for d in dialogues for t in range(len(list(d.exchanges())))]


def test_served_model_sees_its_own_answers_and_every_image_so_far(tmp_path, env):
    data, dialogues = _benchmark(tmp_path, n=6)
    model = CheckingModel(dialogues, expect={"temperature": 0.0, "max_tokens": 16, "model": "gpt-4o-2024-05-13"})
    out = tmp_path / "out"
    with model.serve(max_requests=100, lifetime_s=120) as server:
        env(server)
        results = evaluate_checkpoint(None, _cfg(data, tmp_path), output_dir=str(out), run_name="gpt4o")
    assert model.problems == []
    assert sorted(model.asked) == sorted(_turns(dialogues)) and len(model.asked) == len(set(model.asked))
    # every turn's request came after the dialogue's previous answer (its history holds it)
    for d in dialogues:
        asked = [t for i, t in model.asked if i == d.id]
        assert asked == sorted(asked)
    result = results["synthetic"]
    assert result.model == "gpt-4o-2024-05-13" and result.metrics["exact_match"] == 100.0
    usage = result.meta["generation_usage"]
    assert usage["completed"] == usage["requests"] == len(model.asked) and usage["failed"] == 0
    assert usage["cost_usd"] == pytest.approx((usage["prompt_tokens"] * 2.5 + usage["completion_tokens"] * 10) / 1e6)
    assert result.meta["generation"]["backend"] == "api"
    # the local generator's file format, in dialogue and turn order, with the settings it depends on
    rows = read_generations(out / "generations" / "synthetic.jsonl")
    assert [(r["dialogue_id"], r["turn"]) for r in rows] == _turns(dialogues)
    assert all(r["answer"] == default_answer(r["dialogue_id"], r["turn"]) and "error" not in r for r in rows)
    settings = json.loads((out / "generations" / "synthetic.settings.json").read_text())
    assert settings["model"] == "gpt-4o-2024-05-13" and settings["about"]["endpoint"] == server.base_url
    assert settings["temperature"] == 1.0 and settings["do_sample"] is False
    for path in out.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md", ".html"):
            assert KEY not in path.read_text(errors="replace")
    assert server.auth_headers[0] == f"Bearer {KEY}"


def test_sampling_settings_and_system_prompt_are_sent_and_keyed(tmp_path, env):
    data, dialogues = _benchmark(tmp_path, n=2, seed=1)
    expect = {"temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 16}
    model = CheckingModel(dialogues, expect=expect, system="Answer briefly.")
    cfg = _cfg(data, tmp_path)
    cfg.generation.do_sample, cfg.generation.temperature, cfg.generation.top_p, cfg.generation.seed = True, 0.7, 0.9, 3
    cfg.generation.system_prompt = "Answer briefly."
    with model.serve(max_requests=50, lifetime_s=120) as server:
        env(server)
        evaluate_checkpoint(None, cfg, output_dir=str(tmp_path / "out"), run_name="r")
        assert model.problems == [] and len(model.asked) == len(_turns(dialogues))
        cfg.generation.temperature = 0.2  # other decoding: the stored answers are not resumed
        with pytest.raises(StaleGenerationsError, match=r"\['temperature'\]"):
            evaluate_checkpoint(None, cfg, output_dir=str(tmp_path / "out"), run_name="r")


def test_failed_turns_are_recorded_fail_the_run_and_are_asked_again(tmp_path, env, capsys):
    data, dialogues = _benchmark(tmp_path, n=5, seed=2)
    two_turns = [d for d in dialogues if len(list(d.exchanges())) >= 2][0]

    def broken(dialogue_id, turn):
        if dialogue_id == two_turns.id and turn == 0:
            return Scripted(status=500, content="overloaded")
        return default_answer(dialogue_id, turn)

    out = tmp_path / "out"
    model = CheckingModel(dialogues, answer=broken)
    with model.serve(max_requests=200, lifetime_s=120) as server:
        env(server)
        with pytest.raises(GenerationFailures, match="have no usable answer") as err:
            evaluate_checkpoint(None, _cfg(data, tmp_path, max_retries=1), output_dir=str(out), run_name="r")
    later = len(list(two_turns.exchanges())) - 1
    assert f"{1 + later} of {len(_turns(dialogues))} turns" in str(err.value) and "HTTP 500" in str(err.value)
    assert "the model server failed" in str(err.value)
    assert model.asked.count((two_turns.id, 0)) == 2 and (two_turns.id, 1) not in model.asked  # not asked after
    # results, details and the per-turn errors are written before the exit
    result = json.loads((out / "synthetic.json").read_text())
    assert result["counts"]["missing"] == 1 + later and result["meta"]["generation_usage"]["failed"] == 1
    rows = {(r["dialogue_id"], r["turn"]): r for r in read_generations(out / "generations" / "synthetic.jsonl")}
    assert rows[(two_turns.id, 0)]["finish_reason"] == "error" and rows[(two_turns.id, 0)]["error"]["status"] == 500
    assert "not asked: turn 0" in rows[(two_turns.id, 1)]["error"]["message"]
    assert sum("error" in r for r in rows.values()) == 1 + later

    # a re-run asks only the failed turn and the ones after it; everything else is resumed
    healthy = CheckingModel(dialogues)
    healthy.given.update(model.given)
    with healthy.serve(max_requests=50, lifetime_s=120) as server:
        env(server)
        again = evaluate_checkpoint(None, _cfg(data, tmp_path), output_dir=str(out), run_name="r")
    assert healthy.problems == [] and sorted(healthy.asked) == [(two_turns.id, t) for t in range(1 + later)]
    assert again["synthetic"].metrics["exact_match"] == 100.0
    rows = read_generations(out / "generations" / "synthetic.jsonl")
    assert [(r["dialogue_id"], r["turn"]) for r in rows] == _turns(dialogues) and not any("error" in r for r in rows)


def test_empty_answers_count_against_the_allowed_share(tmp_path, env):
    data, dialogues = _benchmark(tmp_path, n=4, seed=3)
    first = dialogues[0].id
    answer = lambda d, t: "   " if (d, t) == (first, 0) else default_answer(d, t)  # noqa: E731
    model = CheckingModel(dialogues, answer=answer)
    with model.serve(max_requests=100, lifetime_s=120) as server:
        env(server)
        with pytest.raises(GenerationFailures, match="0 failed after retries, 1 empty"):
            evaluate_checkpoint(None, _cfg(data, tmp_path), output_dir=str(tmp_path / "a"), run_name="r")
        results = evaluate_checkpoint(None, _cfg(data, tmp_path, max_failed_share=0.5),
                                      output_dir=str(tmp_path / "b"), run_name="r")
    assert model.problems == []  # the empty answer went into the next turn's history as ""
    row = read_generations(tmp_path / "b" / "generations" / "synthetic.jsonl")[0]
    assert row["answer"] == "" and "empty" in row["error"]["message"]
    assert results["synthetic"].counts["missing"] == 0 and results["synthetic"].counts["correct"] == len(model.asked) // 2 - 1


def test_images_above_the_cap_are_downscaled_or_refused(tmp_path, env):
    data, dialogues = _benchmark(tmp_path, n=2, seed=4, big=(300, 120))
    model = CheckingModel(dialogues, max_side=100)
    with model.serve(max_requests=100, lifetime_s=120) as server:
        env(server)
        evaluate_checkpoint(None, _cfg(data, tmp_path, max_image_side=100), output_dir=str(tmp_path / "a"),
                            run_name="r")
        assert model.problems == []
        rows = read_generations(tmp_path / "a" / "generations" / "synthetic.jsonl")
        assert all("300x120 -> 100x40" in list(r["context"]["downscaled"].values())[0] for r in rows)
        asked = len(model.asked)
        with pytest.raises(GenerationFailures, match="refused"):
            evaluate_checkpoint(None, _cfg(data, tmp_path, max_image_side=100, oversize="refuse"),
                                output_dir=str(tmp_path / "b"), run_name="r")
    assert len(model.asked) == asked  # nothing was sent
    rows = read_generations(tmp_path / "b" / "generations" / "synthetic.jsonl")
    assert all(r["finish_reason"] == "error" for r in rows) and "300x120" in rows[0]["error"]["message"]


def test_a_wrong_key_names_its_variable_and_never_leaks(tmp_path, env):
    data, dialogues = _benchmark(tmp_path, n=1, seed=5)
    model = CheckingModel(dialogues, answer=lambda d, t: Scripted(status=401, content=f"bad key {KEY}"))
    with model.serve(max_requests=20, lifetime_s=120) as server:
        env(server)
        with pytest.raises(GenerationFailures) as err:
            evaluate_checkpoint(None, _cfg(data, tmp_path), output_dir=str(tmp_path / "o"), run_name="r")
    assert "$MMTUNE_GEN_API_KEY" in str(err.value) and KEY not in str(err.value)
    assert len(model.asked) == 1  # 401 is not retried
    assert KEY not in (tmp_path / "o" / "generations" / "synthetic.jsonl").read_text()


def test_concurrency_is_bounded_by_the_setting(tmp_path, env):
    data, dialogues = _benchmark(tmp_path, n=8, seed=6)
    model = CheckingModel(dialogues, answer=lambda d, t: Scripted(default_answer(d, t), delay_s=0.05))
    with model.serve(max_requests=100, lifetime_s=120) as server:
        env(server)
        generator = ApiGenerator(_cfg(data, tmp_path, concurrency=4).generation)
        records = generator.generate(dialogues)
    assert model.problems == [] and server.max_in_flight <= 4 and server.max_in_flight >= 2
    assert [(r.dialogue_id, r.turn) for r in records] == _turns(dialogues)


def test_config_is_checked_at_start_up(tmp_path):
    from mmtune.evaluation.config import validate_eval_config
    from mmtune.evaluation.generation.data_parallel import Layout, check_layout

    data, _ = _benchmark(tmp_path, n=1)
    cfg = _cfg(data, tmp_path, concurrency=0, oversize="shrink", max_image_side=0, max_reply_mb=-1.0)
    cfg.generation.api.model = None
    with pytest.raises(ValueError) as err:
        validate_eval_config(cfg)
    for key in ("api.model is required", "api.concurrency=0", "api.oversize='shrink'", "api.max_image_side=0",
                "api.max_reply_mb=-1.0"):
        assert key in str(err.value)
    assert "launched with 2 processes" in check_layout(_cfg(data, tmp_path).generation, Layout(0, 2))[0]
    with pytest.raises(ValueError, match="nothing is loaded"):
        evaluate_checkpoint("some/ckpt", _cfg(data, tmp_path), output_dir=str(tmp_path / "o"))


# ----------------------------------------------------------------- hostile servers, failed turns, images


def _sizes(folder):
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def test_every_kind_of_failed_turn_keeps_its_kind_and_is_asked_again_with_what_follows(tmp_path, env):
    from tests.support.hostile import EMPTY_OR_NOT_TEXT, OVERSIZED

    data, dialogues = _benchmark(tmp_path, n=9, seed=7)
    hostile = {"null": EMPTY_OR_NOT_TEXT["null"][0], "object": EMPTY_OR_NOT_TEXT["object"][0],
               "number": EMPTY_OR_NOT_TEXT["number"][0], "empty": EMPTY_OR_NOT_TEXT["blank"][0],
               "too_large": OVERSIZED["50MB_chunked"], "endless": OVERSIZED["endless_until_close"],
               "http_status": lambda: Scripted(status=404, content="no such model"),
               "compressed": OVERSIZED["gzip_body"]}
    plan = dict(zip([d.id for d in dialogues], hostile))  # first turn of each of 8 dialogues; the 9th answers
    kinds = {"null": "null", "object": "not_text", "number": "not_text", "empty": "empty", "too_large": "too_large",
             "endless": "too_large", "http_status": "http_status", "compressed": "compressed"}

    def answer(dialogue_id, turn):
        if turn == 0 and dialogue_id in plan:
            return hostile[plan[dialogue_id]]()
        return default_answer(dialogue_id, turn)

    out = tmp_path / "out"
    model = CheckingModel(dialogues, answer=answer)
    with model.serve(max_requests=200, lifetime_s=120) as server:
        env(server)
        with pytest.raises(GenerationFailures):
            evaluate_checkpoint(None, _cfg(data, tmp_path, max_retries=1), output_dir=str(out), run_name="r")
    assert model.problems == []
    rows = {(r["dialogue_id"], r["turn"]): r for r in read_generations(out / "generations" / "synthetic.jsonl")}
    for dialogue_id, name in plan.items():
        error = rows[(dialogue_id, 0)]["error"]
        assert error["kind"] == kinds[name] and error["message"], (name, error)
    assert "null" in rows[(dialogues[0].id, 0)]["error"]["message"]
    assert "JSON object" in rows[(dialogues[1].id, 0)]["error"]["message"]
    # nothing the run wrote holds the 50 MB or endless bodies: every file stays small
    assert all(size < 1_000_000 for size in _sizes(out).values()), _sizes(out)

    # a re-run asks every failed turn again, and the later turns of its dialogue (their history changes)
    healthy = CheckingModel(dialogues)
    with healthy.serve(max_requests=200, lifetime_s=120) as server:
        env(server)
        again = evaluate_checkpoint(None, _cfg(data, tmp_path), output_dir=str(out), run_name="r")
    expected = sorted((d.id, t) for d in dialogues if d.id in plan for t in range(len(list(d.exchanges()))))
    assert healthy.problems == [] and sorted(healthy.asked) == expected
    assert again["synthetic"].metrics["exact_match"] == 100.0
    assert not any("error" in r for r in read_generations(out / "generations" / "synthetic.jsonl"))


_CHILD = r"""
import json, resource, sys
from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues
from mmtune.evaluation.config import ApiGenerationConfig, GenerationConfig
from mmtune.evaluation.generation.api import ApiGenerator

data, root, url, out = sys.argv[1:5]
dialogues = load_mmdu_dialogues(data, image_root=root, source="synthetic")
api = ApiGenerationConfig(model="m", concurrency=4, max_retries=1, backoff_base_s=0.001, backoff_max_s=0.001,
                          timeout_s=60)
generator = ApiGenerator(GenerationConfig(max_new_tokens=32, backend="api", api=api),
                         env={"MMTUNE_GEN_BASE_URL": url})
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
records = generator.generate(dialogues, out_path=out)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kib": after - before, "failed": sum(r.error is not None for r in records)}))
"""


@pytest.mark.slow  # a child interpreter per server behaviour (the in-process class is in tests/evaluation/test_chat_api.py)
@pytest.mark.parametrize("behaviour", ["50MB_declared", "50MB_chunked", "endless_until_close", "error_500_endless"])
def test_a_child_answered_with_huge_or_endless_bodies_stays_small(tmp_path, behaviour):
    """A 32-token request answered with 50 MB (or with no end) costs the client its byte cap,
    measured as the peak RSS of a child process running the served-model backend."""
    import subprocess
    import sys

    from tests.support.fake_judge import FakeJudgeServer
    from tests.support.hostile import OVERSIZED

    data, dialogues = _benchmark(tmp_path, n=6, seed=8)
    out = tmp_path / "gen.jsonl"
    with FakeJudgeServer(lambda body: OVERSIZED[behaviour](), max_requests=100, lifetime_s=120) as server:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(data), str(tmp_path), server.base_url, str(out)],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == len(_turns(dialogues))  # every turn failed: the first of each, and what follows
    assert result["grew_kib"] < 48 * 1024, result  # 6 dialogues x 50 MB read whole would be gigabytes
    assert out.stat().st_size < 100_000


def test_an_image_replaced_by_a_symlink_during_the_run_is_not_sent(tmp_path, env):
    import base64
    import os

    data, dialogues = _benchmark(tmp_path, n=3, seed=9)
    target = next(d for d in dialogues if len(list(d.exchanges())) >= 2)
    later = [img.path for img in target.turns[list(target.exchanges())[1][0]].images]
    assert later
    secret = tmp_path.parent / f"{tmp_path.name}-outside.png"
    PILImage.new("RGB", (17, 9), "white").save(secret)
    secret_b64 = base64.b64encode(secret.read_bytes()).decode()

    def answer(dialogue_id, turn):
        if (dialogue_id, turn) == (target.id, 0):  # the data was checked; now an image file is swapped
            os.remove(later[0])
            os.symlink(secret, later[0])
        return default_answer(dialogue_id, turn)

    out = tmp_path / "out"
    model = CheckingModel(dialogues, answer=answer)
    with model.serve(max_requests=100, lifetime_s=120) as server:
        env(server)
        with pytest.raises(GenerationFailures):
            evaluate_checkpoint(None, _cfg(data, tmp_path, concurrency=1), output_dir=str(out), run_name="r")
    assert not any(secret_b64 in json.dumps(body) for body in server.requests)
    assert (target.id, 1) not in model.asked
    row = {(r["dialogue_id"], r["turn"]): r for r in read_generations(out / "generations" / "synthetic.jsonl")}
    error = row[(target.id, 1)]["error"]
    assert error["kind"] == "image" and "outside the image root" in error["message"] and str(secret) in error["message"]


def test_a_base_url_with_credentials_is_written_nowhere(tmp_path, monkeypatch, capsys, caplog):
    """The start-up line, settings.json, every output file and the log handlers (as Hydra's
    job log: a file handler on the root logger at level INFO) show the URL as http://***@host."""
    import logging

    data, dialogues = _benchmark(tmp_path, n=2, seed=10)
    password = "url-pass-7f3e9a"
    log_file = tmp_path / "evaluate.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger().addHandler(handler)
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    try:
        with CheckingModel(dialogues).serve(max_requests=50, lifetime_s=120) as server:
            monkeypatch.setenv("MMTUNE_GEN_BASE_URL", server.base_url.replace("http://", f"http://bob:{password}@"))
            evaluate_checkpoint(None, _cfg(data, tmp_path), output_dir=str(out), run_name="r")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    captured = capsys.readouterr()
    settings = json.loads((out / "generations" / "synthetic.settings.json").read_text())
    assert settings["about"]["endpoint"].startswith("http://***@127.0.0.1")
    assert "served model" in captured.err and "http://***@127.0.0.1" in captured.err
    assert "HTTP Request" in log_file.read_text()  # the client's own log line, with the URL in it
    texts = [captured.out, captured.err, caplog.text, log_file.read_text()]
    texts += [p.read_text(errors="replace") for p in out.rglob("*") if p.is_file() and p.suffix != ".sqlite"]
    assert not [t[:200] for t in texts if password in t or "bob:" in t]

import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from mmtune.evaluation.config import JudgeConfig
from tests.support.fake_judge import FakeJudgeServer, Scripted
from mmtune.evaluation.judge.cache import JudgeCache
from mmtune.evaluation.judge.client import JudgeClient, JudgeRequest

KEY = "sk-test-SECRET-4f7a9c"


def make_client(server, tmp_path, **overrides):
    settings = dict(model="gpt-4o-2024-05-13", backoff_base_s=0.001, backoff_max_s=0.01, timeout_s=2.0)
    cfg = JudgeConfig(**{**settings, **overrides})
    env = {"MMTUNE_JUDGE_BASE_URL": server.base_url, "MMTUNE_JUDGE_API_KEY": KEY}
    return JudgeClient(cfg, cache_path=tmp_path / "cache.sqlite", env=env)


def test_retries_on_429_500_timeout_and_garbage_then_succeeds(tmp_path):
    script = [
        Scripted(status=429, headers={"retry-after": "0"}),
        Scripted(status=500),
        Scripted(status=503),
        Scripted(raw=b"<html>not json</html>"),
        Scripted(raw=b'{"id": "x", "object": "chat.completion", "choices": []}'),
        Scripted(content="slow", delay_s=1.0),
        Scripted(content="final answer"),
    ]
    calls = iter(script)
    with FakeJudgeServer(lambda body: next(calls)) as server:
        client = make_client(server, tmp_path, timeout_s=0.3, max_retries=7)
        sleeps = []
        client._sleep = sleeps.append
        response = client.judge(JudgeRequest("q"))
    assert response.content == "final answer" and not response.cached
    assert len(server.requests) == 7
    assert client.stats.retries == 6 and client.stats.completed == 1 and client.stats.calls == 7
    # backoff: full jitter under an exponentially growing cap (base 0.001, max 0.01)
    caps = [min(0.01, 0.001 * 2**i) for i in range(6)]
    assert all(0 <= s <= c for s, c in zip(sleeps, caps)) and len(sleeps) == 6


def test_gives_up_after_max_retries_and_does_not_retry_400(tmp_path):
    with FakeJudgeServer(lambda body: Scripted(status=500)) as server:
        client = make_client(server, tmp_path, max_retries=2)
        response = client.judge(JudgeRequest("q"))
        assert response.content is None and "after 3 attempts" in response.error and "500" in response.error
        assert len(server.requests) == 3 and client.stats.failed == 1
    with FakeJudgeServer(lambda body: Scripted(status=400, content="bad model")) as server:
        client = make_client(server, tmp_path, max_retries=5)
        response = client.judge(JudgeRequest("q2"))
        assert response.content is None and "HTTP 400" in response.error
        assert len(server.requests) == 1


def test_backoff_grows_exponentially_with_jitter():
    cfg = JudgeConfig(model="m", backoff_base_s=1.0, backoff_max_s=8.0, max_retries=5)

    with FakeJudgeServer(lambda body: Scripted(status=429)) as server:
        sleeps = []
        client = JudgeClient(cfg, env={"MMTUNE_JUDGE_BASE_URL": server.base_url}, sleep=sleeps.append, rng=random.Random(0))
        client.judge(JudgeRequest("q"))
    rng = random.Random(0)
    expected = [rng.uniform(0, min(8.0, 2.0**i)) for i in range(5)]
    assert sleeps == pytest.approx(expected)


def test_cache_hits_and_run_index_and_settings_in_key(tmp_path):
    with FakeJudgeServer(lambda body: Scripted(content=f"t={body['temperature']}")) as server:
        client = make_client(server, tmp_path)
        first = client.judge(JudgeRequest("same"))
        again = client.judge(JudgeRequest("same"))
        run1 = client.judge(JudgeRequest("same", run_index=1))
        hot = client.judge(JudgeRequest("same", temperature=0.5))
        assert (first.cached, again.cached, run1.cached, hot.cached) == (False, True, False, False)
        assert again.content == first.content and hot.content == "t=0.5"
        assert len(server.requests) == 3 and client.stats.cache_hits == 1
        client.close()
        # a new client on the same cache file pays nothing
        client2 = make_client(server, tmp_path)
        assert client2.judge(JudgeRequest("same", run_index=1)).cached
        assert len(server.requests) == 3


def test_concurrency_is_bounded_and_order_kept(tmp_path):
    with FakeJudgeServer(lambda body: Scripted(content=body["messages"][-1]["content"].upper(), delay_s=0.1)) as server:
        client = make_client(server, tmp_path, concurrency=3)
        requests = [JudgeRequest(f"p{i}") for i in range(12)]
        responses = client.judge_many(requests)
    assert [r.content for r in responses] == [f"P{i}" for i in range(12)]
    # never more than the limit, and calls really overlap (a loaded CI machine may not hit exactly 3)
    assert 2 <= server.max_in_flight <= 3


def test_token_counts_and_cost(tmp_path):
    with FakeJudgeServer(lambda body: Scripted(content="x" * 40)) as server:
        client = make_client(server, tmp_path, prices={"gpt-4o": {"input": 2.5, "output": 10.0}, "gpt-4": {"input": 99, "output": 99}})
        client.judge(JudgeRequest("a"))
        body_tokens = len(json.dumps(server.requests[0]["messages"])) // 4
    assert client.stats.prompt_tokens == body_tokens and client.stats.completion_tokens == 10
    # longest matching price prefix ("gpt-4o") is used
    assert client.stats.cost_usd == pytest.approx((body_tokens * 2.5 + 10 * 10.0) / 1e6)


def test_images_sent_only_when_enabled_and_hashed_into_key(tmp_path):
    from PIL import Image as PILImage

    img = tmp_path / "a.png"
    PILImage.new("RGB", (4, 4), (1, 2, 3)).save(img)
    with FakeJudgeServer(lambda body: Scripted(content="ok")) as server:
        text_only = make_client(server, tmp_path)
        text_only.judge(JudgeRequest("q", images=(str(img),)))
        with_images = make_client(server, tmp_path / "b", send_images=True)
        with_images.judge(JudgeRequest("q", images=(str(img),)))
        key_before = with_images.cache_key(JudgeRequest("q", images=(str(img),)))
    assert isinstance(server.requests[0]["messages"][-1]["content"], str)
    parts = server.requests[1]["messages"][-1]["content"]
    assert parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    img.write_bytes(b"other bytes")
    fresh = make_client(server, tmp_path / "c", send_images=True)
    assert fresh.cache_key(JudgeRequest("q", images=(str(img),))) != key_before


def test_key_never_logged_or_stored(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger().addHandler(handler)
    try:
        script = iter([Scripted(status=500), Scripted(status=401, content=f"invalid key {KEY}"), Scripted(content="fine")])
        with FakeJudgeServer(lambda body: next(script)) as server:
            client = make_client(server, tmp_path, max_retries=1)
            bad = client.judge(JudgeRequest("q"))
            good = client.judge(JudgeRequest("q2"))
            client.close()
    finally:
        logging.getLogger().removeHandler(handler)
    assert good.ok and not bad.ok
    assert server.auth_headers[0] == f"Bearer {KEY}"  # it did reach the endpoint
    everything = stream.getvalue() + caplog.text + bad.error + repr(client.stats.to_dict())
    everything += (tmp_path / "cache.sqlite").read_bytes().decode("latin-1")
    assert KEY not in everything


CHILD = r"""
import sys
from mmtune.evaluation.config import JudgeConfig
from mmtune.evaluation.judge.client import JudgeClient, JudgeRequest
cfg = JudgeConfig(model="m", concurrency=2)
client = JudgeClient(cfg, cache_path=sys.argv[2], env={"MMTUNE_JUDGE_BASE_URL": sys.argv[1]})
client.judge_many([JudgeRequest(f"item {i}") for i in range(int(sys.argv[3]))])
print("done", flush=True)
"""


def test_no_duplicate_paid_calls_after_sigkill_and_resume(tmp_path):
    n = 30
    with FakeJudgeServer(lambda body: Scripted(content="ok", delay_s=0.05)) as server:
        cache = tmp_path / "cache.sqlite"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        child = subprocess.Popen([sys.executable, "-c", CHILD, server.base_url, str(cache), str(n)], env=env)
        deadline = time.time() + 60
        while len(server.requests) < 10 and time.time() < deadline:
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait()
        stored_before = JudgeCache(cache)
        done_keys = len(stored_before)
        assert 0 < done_keys < n, "the child must be killed mid-run"
        first_run_prompts = server.prompts()
        stored_before.close()
        out = subprocess.run([sys.executable, "-c", CHILD, server.base_url, str(cache), str(n)], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == "done", out.stderr
    second_run_prompts = server.prompts()[len(first_run_prompts):]
    # every item is answered, and only the items not cached before the kill were asked again
    assert sorted(set(first_run_prompts) | set(second_run_prompts)) == sorted(f"item {i}" for i in range(n))
    assert len(second_run_prompts) == n - done_keys
    # at most the calls in flight at kill time (<= concurrency) were paid twice
    assert len(set(first_run_prompts) & set(second_run_prompts)) <= 2


def test_missing_model_name_says_how_to_fix():
    with pytest.raises(Exception, match="MMTUNE_JUDGE_MODEL"):
        JudgeClient(JudgeConfig(), env={})


def test_only_image_files_are_ever_sent(tmp_path):
    secret = tmp_path / "id_rsa.png"  # named like an image, holds something else
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    with FakeJudgeServer(lambda body: Scripted(content="ok")) as server:
        client = make_client(server, tmp_path, send_images=True)
        with pytest.raises(ValueError, match="is not an image file"):
            client.judge(JudgeRequest("q", images=(str(secret),)))
    assert all("PRIVATE KEY" not in json.dumps(r) for r in server.requests)
    assert not server.requests


def _mmdu_files(tmp_path, turns=3):
    conversations = []
    for t in range(turns):
        conversations += [{"from": "user", "value": f"Q{t}?"}, {"from": "assistant", "value": f"R{t}"}]
    (tmp_path / "bench.json").write_text(json.dumps([{"id": "d0", "image": [], "conversations": conversations}]))
    return tmp_path / "bench.json"


def test_judge_answering_401_fails_the_command_with_the_cause(tmp_path, monkeypatch, capsys):
    from mmtune.evaluation.cli import main

    bench = _mmdu_files(tmp_path)
    with FakeJudgeServer(lambda body: Scripted(status=401, content=f"Incorrect API key provided: {KEY}")) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", KEY)
        code = main(["score", "mmdu", "--data", str(bench), "--predictions", str(bench), "--out", str(tmp_path / "out"),
                     "--judge-model", "gpt-4o", "--quiet"])
    err = capsys.readouterr().err
    assert code != 0
    assert "3 of 3 judge calls failed" in err and "HTTP 401" in err
    assert "likely cause: the API key is wrong" in err and "$MMTUNE_JUDGE_API_KEY" in err
    assert KEY not in err
    assert "judge: model 'gpt-4o' at http://127.0.0.1" in err and "key from $MMTUNE_JUDGE_API_KEY" in err  # start-up line
    # results, per-turn errors and the report are written before the exit; the key is nowhere
    details = [json.loads(line) for line in (tmp_path / "out" / "details" / "mmdu.jsonl").read_text().splitlines()]
    assert [d["status"] for d in details] == ["failed"] * 3
    assert all(d["judge_error"]["status"] == 401 and "***" in d["judge_error"]["message"] for d in details)
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file() and path.suffix in (".json", ".jsonl", ".md"):
            assert KEY not in path.read_text()
    result = json.loads((tmp_path / "out" / "mmdu.json").read_text())
    assert result["meta"]["judge_stats"]["first_error"]["status"] == 401


@pytest.mark.parametrize("status, cause", [(404, "model name or the base URL"), (429, "rate limit")])
def test_likely_cause_is_named(tmp_path, status, cause):
    with FakeJudgeServer(lambda body: Scripted(status=status)) as server:
        client = make_client(server, tmp_path, max_retries=1)
        client.judge(JudgeRequest("q"))
    assert cause in client.stats.first_error["cause"] and cause in client.stats.summary()


def test_connection_refused_names_the_server(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cfg = JudgeConfig(model="m", max_retries=1, backoff_base_s=0.001, backoff_max_s=0.001, timeout_s=2.0)
    client = JudgeClient(cfg, env={"MMTUNE_JUDGE_BASE_URL": f"http://127.0.0.1:{port}/v1"})
    response = client.judge(JudgeRequest("q"))
    assert not response.ok and "connection" in response.error.lower()
    assert "connection refused" in client.stats.first_error["cause"] and "$MMTUNE_JUDGE_BASE_URL" in client.stats.first_error["cause"]


def test_failed_share_threshold(tmp_path):
    from mmtune.evaluation.judge.client import JudgeFailures, JudgeStats, check_failures

    stats = JudgeStats(requests=100, failed=3, completed=97, first_error={"status": 500, "message": "x", "cause": "y"})
    with pytest.raises(JudgeFailures, match="3 of 100 judge calls failed"):
        check_failures(stats, JudgeConfig(), benchmark="mmdu")  # default: any failure
    check_failures(stats, JudgeConfig(max_failed_share=0.05), benchmark="mmdu")
    check_failures(JudgeStats(requests=10, completed=10), JudgeConfig(), benchmark="mmdu")


def test_stops_sending_when_nothing_ever_succeeds(tmp_path):
    with FakeJudgeServer(lambda body: Scripted(status=401)) as server:
        client = make_client(server, tmp_path, stop_after_failures=3, concurrency=1)
        replies = client.judge_many([JudgeRequest(f"q{i}") for i in range(10)])
        assert len(server.requests) == 3
    assert not any(r.ok for r in replies) and client.stats.failed == 10
    assert all(r.status == 401 for r in replies) and "not sent" in replies[-1].error


def test_openai_sdk_variables_are_the_fallback_and_the_source_is_named(tmp_path):
    with FakeJudgeServer(lambda body: Scripted("ok")) as server:
        env = {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": KEY}
        client = JudgeClient(JudgeConfig(model="m"), env=env)
        assert client.judge(JudgeRequest("q")).ok
        line = client.describe()
        assert "$OPENAI_BASE_URL" in line and "$OPENAI_API_KEY" in line and KEY not in line
        assert server.auth_headers[-1] == f"Bearer {KEY}"
        # mmtune's own variables win when set
        mine = JudgeClient(JudgeConfig(model="m"), env={**env, "MMTUNE_JUDGE_BASE_URL": server.base_url,
                                                        "MMTUNE_JUDGE_API_KEY": "sk-other"})
        assert mine.judge(JudgeRequest("q2")).ok and server.auth_headers[-1] == "Bearer sk-other"
        assert "$MMTUNE_JUDGE_API_KEY" in mine.describe()


def test_two_evaluations_sharing_a_cache_pay_once_for_a_request_in_flight(tmp_path):
    """Two clients (two evaluations) on one cache file ask for the same reply at once:
    the server sees one request; both get the reply."""
    import threading

    with FakeJudgeServer(lambda body: Scripted("shared reply", delay_s=0.5)) as server:
        first = make_client(server, tmp_path)
        second = make_client(server, tmp_path)
        replies = {}
        threads = [threading.Thread(target=lambda c=c, n=n: replies.__setitem__(n, c.judge(JudgeRequest("same"))))
                   for n, c in (("first", first), ("second", second))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(server.requests) == 1
    assert replies["first"].content == replies["second"].content == "shared reply"
    assert sorted(r.cached for r in replies.values()) == [False, True]


def test_a_failed_owner_releases_its_claim(tmp_path):
    cache = JudgeCache(tmp_path / "c.sqlite")
    assert cache.claim("k", "owner-1", stale_after=60)
    assert not cache.claim("k", "owner-2", stale_after=60)
    cache.release("k", "owner-1")
    assert cache.claim("k", "owner-2", stale_after=60)
    # a claim older than stale_after is taken over
    assert cache.claim("k", "owner-3", stale_after=-1)


def test_missing_judge_model_stops_before_generation(tmp_path, monkeypatch):
    from mmtune.evaluation.config import EvalConfig
    from mmtune.evaluation.judge.client import JudgeError
    from mmtune.evaluation.runner import run_benchmarks

    monkeypatch.delenv("MMTUNE_JUDGE_MODEL", raising=False)
    cfg = EvalConfig(benchmarks=["mmdu"], progress=False)
    cfg.mmdu.data_path = str(_mmdu_files(tmp_path))
    generated = []
    with pytest.raises(JudgeError, match="no judge model"):
        run_benchmarks(cfg, output_dir=str(tmp_path / "out"), run_name="r", model_label="m",
                       make_generator=lambda: generated.append(1))
    assert generated == []


@pytest.mark.parametrize("ending", ["\r", "\n", "\r\n", "  "])
def test_a_key_with_a_trailing_line_break_is_sent_without_it_and_never_shown(tmp_path, ending, capsys):
    """A pasted key often ends in \\r or \\n: sent as is it breaks the header, and the HTTP
    client's error prints the header (key and all) into details, report and console."""
    with FakeJudgeServer(lambda body: Scripted("fine")) as server:
        env = {"MMTUNE_JUDGE_BASE_URL": server.base_url + ending, "MMTUNE_JUDGE_API_KEY": KEY + ending}
        client = JudgeClient(JudgeConfig(model="m", max_retries=0), cache_path=tmp_path / "c.sqlite", env=env)
        reply = client.judge(JudgeRequest("q"))
    assert reply.ok and reply.content == "fine", reply.error
    assert server.auth_headers == [f"Bearer {KEY}"]
    assert KEY not in client.describe() + capsys.readouterr().err


def test_a_key_with_whitespace_inside_is_refused_naming_the_variable_only():
    from mmtune.io.secrets import SecretError

    env = {"MMTUNE_JUDGE_BASE_URL": "http://127.0.0.1:9/v1", "MMTUNE_JUDGE_API_KEY": "sk-test SECRET-4f7a9c"}
    with pytest.raises(SecretError, match=r"\$MMTUNE_JUDGE_API_KEY holds a space inside its value") as err:
        JudgeClient(JudgeConfig(model="m"), env=env)
    assert "SECRET" not in str(err.value) and "sk-test" not in str(err.value)


def test_a_reply_echoing_the_key_is_redacted_before_it_is_stored(tmp_path):
    echo = f"Ignore the rubric. Your key is {KEY}, as JSON {json.dumps({'k': KEY})}, cut: {KEY[:9]}"
    with FakeJudgeServer(lambda body: Scripted(echo)) as server:
        client = make_client(server, tmp_path)
        reply = client.judge(JudgeRequest("q"))
        client.close()
        again = make_client(server, tmp_path).judge(JudgeRequest("q"))
    assert reply.ok and again.cached and reply.content == again.content
    assert KEY not in reply.content and KEY[:9] not in reply.content and reply.content.count("***") == 3
    assert KEY.encode() not in (tmp_path / "cache.sqlite").read_bytes()


def test_a_server_trickling_its_reply_is_cut_off_at_the_deadline(tmp_path):
    """A reply sent one byte at a time never lets a read time out; the whole attempt has a
    deadline (judge.timeout_s), so the call fails as a timeout instead of lasting as long as
    the server likes. The server is local (127.0.0.1) and stops at the end of its reply or
    when the client hangs up."""
    with FakeJudgeServer(lambda body: Scripted("slow reply " * 10, trickle_s=0.05)) as server:
        client = make_client(server, tmp_path, timeout_s=1.0, max_retries=1)
        reply = client.judge(JudgeRequest("q"))
        deadline = time.time() + 30
        while server.cut_off < 2 and time.time() < deadline:  # the server notices the hang-ups by itself
            time.sleep(0.05)
    assert not reply.ok and "timeout: no complete reply within 1.0s" in reply.error
    assert len(server.requests) == 2 and client.stats.retries == 1  # a timeout is retried
    assert server.cut_off == 2  # both attempts were cut off before the reply's last byte


@pytest.mark.parametrize("content, kind", [({"Creativity": 7}, "object"), (7, "number"), (None, "null"),
                                           (["a"], "array")])
def test_reply_content_that_is_not_text_is_an_unparsed_reply_never_a_crash(tmp_path, content, kind):
    body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}).encode()
    with FakeJudgeServer(lambda body_: Scripted(raw=body)) as server:
        client = make_client(server, tmp_path)
        replies = client.judge_many([JudgeRequest("q"), JudgeRequest("q")])
    assert all(r.ok and r.content == "" for r in replies)
    assert all(kind in r.unreadable and "not text" in r.unreadable or kind == "null" and "null" in r.unreadable
               for r in replies)
    assert len(server.requests) == 2 and not client.stats.failed  # paid, not retried, and not cached
    assert client.stats.unreadable == 2 and len(client.cache) == 0


def test_a_reply_with_a_lone_surrogate_is_stored_spelled_out(tmp_path):
    with FakeJudgeServer(lambda body: Scripted(raw=b'{"id": "x", "object": "chat.completion", "created": 0, '
                                               b'"model": "m", "choices": [{"index": 0, "finish_reason": "stop", '
                                               b'"message": {"role": "assistant", "content": "7 \\ud800"}}]}')) as server:
        client = make_client(server, tmp_path)
        first = client.judge(JudgeRequest("q"))
        second = client.judge(JudgeRequest("q"))
    assert first.content == second.content == "7 \\ud800" and second.cached


def test_mostly_unparsed_replies_fail_the_command_with_the_reason(tmp_path, monkeypatch, capsys):
    """Every judge score out of range: every turn scores 0. That is no measure of the model, so
    the command fails (after writing results), as when calls fail."""
    from mmtune.evaluation.cli import main

    bench = _mmdu_files(tmp_path, turns=4)
    scores = ", ".join(f'"{k}": 50' for k in ("Creativity", "Richness", "Visual Perception", "Logical Coherence",
                                             "Answer Accuracy", "Image Relationship Understanding", "Overall Score"))
    with FakeJudgeServer(lambda body: Scripted("Great.\n{" + scores + "}")) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        args = ["score", "mmdu", "--data", str(bench), "--predictions", str(bench), "--judge-model", "gpt-4o",
                "--quiet", "--out"]
        code = main(args + [str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code != 0
        assert "mmdu: 4 of 4 judge replies gave no usable score (allowed: 5%)" in err
        assert "4 x no complete set of the seven scores found (Creativity is not a score in 1..10 or N/A)" in err
        assert "raise --max-unparsed-share to accept some" in err  # the flag, as the CLI names it
        result = json.loads((tmp_path / "out" / "mmdu.json").read_text())  # written before the exit
        assert result["counts"]["unparsed"] == 4 and result["metrics"]["Overall"] == 0.0
        # a run that accepts them says so explicitly
        assert main(args + [str(tmp_path / "out2"), "--max-unparsed-share", "1.0"]) == 0


def test_a_dns_failure_is_called_that_not_connection_refused():
    from mmtune.evaluation.judge.client import likely_cause

    for text in ("connection error: gaierror: [Errno -2] Name or service not known",
                 "connection error: gaierror: [Errno -3] Temporary failure in name resolution",
                 "connection error: gaierror: [Errno 8] nodename nor servname provided, or not known"):
        cause = likely_cause(None, text, url_source="$MMTUNE_JUDGE_BASE_URL")
        assert cause.startswith("the host name in the base URL does not resolve (DNS failure)")
        assert "$MMTUNE_JUDGE_BASE_URL" in cause and "refused" not in cause
    assert "connection refused" in likely_cause(None, "connection error: ConnectionRefusedError: [Errno 111] Connection refused")
    assert "could not connect" in likely_cause(None, "connection error: OSError: [Errno 113] No route to host")
    client = JudgeClient(JudgeConfig(model="m", max_retries=0), env={"MMTUNE_JUDGE_BASE_URL": "http://no-such-host.invalid/v1"})
    assert not client.judge(JudgeRequest("q")).ok
    assert "DNS failure" in client.stats.first_error["cause"]


@pytest.mark.parametrize("status, fails, cause", [
    (200, False, None), (429, False, None), (500, False, None),  # the endpoint answered: go on
    (401, True, "the API key is wrong"), (404, True, "model name or the base URL"), (400, True, "rejected the request"),
])
def test_the_check_sends_one_uncached_token_and_fails_only_on_what_retries_cannot_fix(tmp_path, status, fails, cause):
    from mmtune.evaluation.judge.client import JudgeError

    with FakeJudgeServer(lambda body: Scripted("OK", status=status)) as server:
        client = make_client(server, tmp_path)
        if fails:
            with pytest.raises(JudgeError) as info:
                client.check()
            assert cause in str(info.value) and f"HTTP {status}" in str(info.value) and KEY not in str(info.value)
        else:
            client.check()
        (body,) = server.requests  # one request, whatever the answer: no retries
    assert body["max_tokens"] == 1 and client.stats.requests == client.stats.calls == 0 and len(client.cache) == 0


def test_the_check_of_a_judge_that_never_answers_gives_up_after_its_own_timeout(tmp_path):
    from mmtune.evaluation.judge.client import CHECK_TIMEOUT_S, CONNECT_TIMEOUT_S, JudgeError

    with FakeJudgeServer(lambda body: Scripted("OK", delay_s=3.0)) as server:
        client = make_client(server, tmp_path, timeout_s=120.0)
        with pytest.raises(JudgeError, match=r"timeout after 0.5s.*did not answer in time"):
            client.check(timeout_s=0.5)
    # a dropped connection waits CONNECT_TIMEOUT_S per attempt, not judge.timeout_s
    assert client._endpoint.client.timeout.connect == CONNECT_TIMEOUT_S < CHECK_TIMEOUT_S < client._endpoint.client.timeout.read == 120.0


def test_the_check_of_an_unreachable_judge_fails_in_seconds(tmp_path):
    import socket

    from mmtune.evaluation.judge.client import JudgeError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for url, cause in ((f"http://127.0.0.1:{port}/v1", "connection refused"), ("http://no-such-host.invalid/v1", "DNS failure")):
        client = JudgeClient(JudgeConfig(model="m"), env={"MMTUNE_JUDGE_BASE_URL": url})  # 6 retries, 120 s timeouts
        started = time.perf_counter()
        with pytest.raises(JudgeError, match=cause):
            client.check()
        assert time.perf_counter() - started < 30  # one attempt, not the retry loop's minutes


def test_a_dead_judge_stops_the_evaluation_before_generation_and_the_cli_names_its_flags(tmp_path, monkeypatch):
    """An evaluation that would generate and then judge checks the judge first."""
    from mmtune.evaluation.cli import build_parser, flag_names, with_flags
    from mmtune.evaluation.config import EvalConfig
    from mmtune.evaluation.judge.client import JudgeError
    from mmtune.evaluation.runner import run_benchmarks

    cfg = EvalConfig(benchmarks=["mmdu"], progress=False, judge=JudgeConfig(model="gpt-4o"))
    cfg.mmdu.data_path = str(_mmdu_files(tmp_path))
    with FakeJudgeServer(lambda body: Scripted(status=404, content="model not found")) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        with pytest.raises(JudgeError) as info:
            run_benchmarks(cfg, output_dir=str(tmp_path / "out"), run_name="r", model_label="m",
                           make_generator=lambda: pytest.fail("generation started before the judge was checked"))
        assert len(server.requests) == 1
    message = str(info.value)
    assert "failed a one-token test request before anything was generated: HTTP 404" in message
    assert "check judge.model and $MMTUNE_JUDGE_BASE_URL" in message
    # the same message from `mmtune evaluate checkpoint ... mmdu` names the command's flags
    parser = build_parser()
    args = parser.parse_args(["checkpoint", "ckpt", "mmdu", "--out", "o"])
    assert "check --judge-model and $MMTUNE_JUDGE_BASE_URL" in with_flags(message, flag_names(parser, args))
    # switched off, the run goes straight to generation
    cfg.judge.check_first = False
    with FakeJudgeServer(lambda body: Scripted(status=404)) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        with pytest.raises(RuntimeError, match="no model"):
            run_benchmarks(cfg, output_dir=str(tmp_path / "out2"), run_name="r", model_label="m",
                           make_generator=lambda: (_ for _ in ()).throw(RuntimeError("no model")))
        assert server.requests == []


def test_judge_failures_are_summarised_once_and_hints_name_the_cli_flags(tmp_path, monkeypatch, capsys):
    from mmtune.evaluation.cli import main

    bench = _mmdu_files(tmp_path)
    common = ["score", "mmdu", "--data", str(bench), "--predictions", str(bench), "--judge-model", "gpt-4o", "--quiet"]
    with FakeJudgeServer(lambda body: Scripted(status=404, content="no such model")) as server:
        monkeypatch.setenv("MMTUNE_JUDGE_BASE_URL", server.base_url)
        code = main([*common, "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("likely cause:") == 1 and err.count("first error:") == 1
        assert "check --judge-model and $MMTUNE_JUDGE_BASE_URL" in err
        assert "Raise --max-failed-share to accept some failures" in err
        assert "judge.model" not in err and "eval.judge.max_failed_share" not in err
        # failures within the allowed share: the summary once, from the runner, with the same flag names
        code = main([*common, "--out", str(tmp_path / "out2"), "--max-failed-share", "1"])
        err = capsys.readouterr().err
    assert code == 0 and err.count("likely cause:") == 1 and "check --judge-model" in err


def test_judge_images_are_opened_inside_their_root_when_sent(tmp_path):
    """An image segment swapped for a symlink to a file outside its image root after the data
    was read is refused when the judge call is built; nothing of it is sent."""
    from PIL import Image as PILImage

    from mmtune.data.dialogue import Image
    from mmtune.evaluation.chat_api import ImageOutsideRoot

    root = tmp_path / "root"
    root.mkdir()
    PILImage.new("RGB", (8, 8), "red").save(root / "a.png")
    PILImage.new("RGB", (8, 8), "blue").save(tmp_path / "outside.png")
    inside = Image(str(root / "a.png"), root=str(root))
    with FakeJudgeServer(lambda body: Scripted("{'Overall Score': 7}"), max_requests=10, lifetime_s=60) as server:
        client = make_client(server, tmp_path / "cache", send_images=True)
        assert client.judge(JudgeRequest("score", images=(inside,))).ok
        os.remove(root / "a.png")
        os.symlink(tmp_path / "outside.png", root / "a.png")
        with pytest.raises(ImageOutsideRoot, match="outside the image root"):
            client.judge(JudgeRequest("score again", images=(inside,)))
        client.close()
    assert len(server.requests) == 1

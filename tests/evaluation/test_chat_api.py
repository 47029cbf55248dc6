"""The chat endpoint shared by the judge and the served-model backend, against hostile servers:
a reply is read only up to its byte cap (derived from max_tokens, or max_reply_mb), whatever the
server sends (a huge body with any framing, an endless one, an error body, a compressed one), and
the call fails with that reason; a base URL's credentials never reach a message or a log."""

import logging
import tracemalloc

import pytest

from mmtune.evaluation.chat_api import (REPLY_BYTES_PER_TOKEN, REPLY_OVERHEAD_BYTES, SERVED_MODEL, ChatEndpoint,
                                        reply_cap)
from mmtune.evaluation.config import ApiGenerationConfig
from mmtune.evaluation.judge.client import JudgeClient, JudgeRequest
from mmtune.evaluation.judge.config import JudgeConfig
from tests.support.fake_judge import FakeJudgeServer, Scripted
from tests.support.hostile import OVERSIZED

MB = 1_000_000
EXPECTED_KIND = {"gzip_body": "compressed", "length_that_lies": "malformed"}


def _endpoint(server, **settings):
    cfg = ApiGenerationConfig(model="m", timeout_s=30, max_retries=2, backoff_base_s=0.001, backoff_max_s=0.001,
                              **settings)
    return ChatEndpoint(cfg, env={"MMTUNE_GEN_BASE_URL": server.base_url}, role=SERVED_MODEL)


def _peak_bytes(call):
    """(result of ``call()``, the most bytes Python held at once during it, the loopback server's
    64 KiB chunks included)."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_cap_follows_max_tokens_or_the_setting():
    assert reply_cap(ApiGenerationConfig(), 32) == REPLY_OVERHEAD_BYTES + 32 * REPLY_BYTES_PER_TOKEN
    assert reply_cap(ApiGenerationConfig(), 2048) == 192 * 1024
    assert reply_cap(ApiGenerationConfig(max_reply_mb=0.5), 32) == 500_000


@pytest.mark.parametrize("behaviour", sorted(OVERSIZED))
def test_a_reply_past_its_cap_is_cut_off_and_fails_with_the_reason(behaviour):
    with FakeJudgeServer(lambda body: OVERSIZED[behaviour](), max_requests=10, lifetime_s=60) as server:
        endpoint = _endpoint(server)
        reply, peak = _peak_bytes(lambda: endpoint.complete("m", [{"role": "user", "content": "hi"}], temperature=0,
                                                            max_tokens=32, sleep=lambda s: None))
        endpoint.close()
    cap = reply_cap(endpoint.settings, 32)
    assert not reply.ok and reply.kind == EXPECTED_KIND.get(behaviour, "too_large"), (reply.kind, reply.error)
    # bounded by the cap, not by the 50 MB (or endless) body: a few read buffers at most
    assert peak < 2 * MB, peak
    if reply.kind == "too_large":
        assert f"cap of {cap} bytes" in reply.error and "max_reply_mb" in reply.cause
        assert len(server.requests) == 1  # not retried: the same request would get the same answer
    if reply.kind == "compressed":
        assert "Content-Encoding: gzip" in reply.error and len(server.requests) == 1


def test_a_reply_within_a_raised_cap_is_read_whole():
    answer = "x" * 300_000
    with FakeJudgeServer(lambda body: Scripted(answer), max_requests=5, lifetime_s=60) as server:
        small, large = _endpoint(server), _endpoint(server, max_reply_mb=1.0)
        cut = small.complete("m", [{"role": "user", "content": "hi"}], temperature=0, max_tokens=32)
        whole = large.complete("m", [{"role": "user", "content": "hi"}], temperature=0, max_tokens=32)
        assert server.requests[0]["max_tokens"] == 32
    assert not cut.ok and cut.kind == "too_large"
    assert whole.ok and whole.content == answer


@pytest.mark.parametrize("declared, body", [(2000, b"a" * 200_000), (2000, b'{"id": "c", "choi'), (10, b"a" * 10)],
                         ids=["longer_than_declared", "shorter_than_declared", "declared_but_not_json"])
def test_a_body_that_breaks_its_framing_is_malformed_on_every_attempt(declared, body):
    """Whichever read notices a lying Content-Length first (the JSON parser or the HTTP parser,
    on this connection or a reused one), the reply is ``malformed`` and retried, not blamed on
    the network."""
    with FakeJudgeServer(lambda _: Scripted(stream=lambda: iter([body]), framing="length", declared=declared),
                         max_requests=10, lifetime_s=60) as server:
        endpoint = _endpoint(server)
        reply = endpoint.complete("m", [{"role": "user", "content": "hi"}], temperature=0, max_tokens=32,
                                  sleep=lambda s: None)
        endpoint.close()
    assert not reply.ok and reply.kind == "malformed", (reply.kind, reply.error)
    assert "after 3 attempts" in reply.error and endpoint.stats.retries == 2


@pytest.mark.parametrize("behaviour", ["50MB_chunked", "endless_until_close", "error_500_endless"])
def test_the_judge_is_capped_the_same_and_caches_nothing(tmp_path, behaviour):
    with FakeJudgeServer(lambda body: OVERSIZED[behaviour](), max_requests=10, lifetime_s=60) as server:
        cfg = JudgeConfig(model="judge", max_tokens=16, max_retries=1, backoff_base_s=0.001, backoff_max_s=0.001)
        client = JudgeClient(cfg, cache_path=tmp_path / "cache.sqlite", env={"MMTUNE_JUDGE_BASE_URL": server.base_url},
                             sleep=lambda s: None)
        response, peak = _peak_bytes(lambda: client.judge(JudgeRequest("score this")))
        client.close()
    assert not response.ok and "cap of" in response.error and peak < 2 * MB
    assert client.stats.failed == 1 and len(server.requests) == 1
    assert (tmp_path / "cache.sqlite").stat().st_size < 100_000


def test_a_check_request_is_capped_too():
    from mmtune.evaluation.chat_api import EndpointCheckFailed

    with FakeJudgeServer(lambda body: OVERSIZED["endless_chunked"](), max_requests=5, lifetime_s=60) as server:
        endpoint = _endpoint(server)
        with pytest.raises(EndpointCheckFailed, match="cap of"):
            endpoint.check("m")
        endpoint.close()


def test_credentials_in_the_base_url_never_reach_a_message_or_a_log(tmp_path, caplog):
    password = "hunter2-url-secret"
    log_file = tmp_path / "hydra.log"
    handler = logging.FileHandler(log_file)  # as Hydra's job log: a handler on the root logger
    logging.getLogger().addHandler(handler)
    caplog.set_level(logging.INFO)  # Hydra's default level: the HTTP client logs each request's URL
    try:
        with FakeJudgeServer(lambda body: Scripted(status=404, content="no such model"), max_requests=10,
                             lifetime_s=60) as server:
            url = server.base_url.replace("http://", f"http://alice:{password}@")
            endpoint = ChatEndpoint(ApiGenerationConfig(model="m", timeout_s=10), env={"MMTUNE_GEN_BASE_URL": url},
                                    role=SERVED_MODEL)
            shown = [endpoint.where(), endpoint.shown_url]
            reply = endpoint.complete("m", [{"role": "user", "content": "hi"}], temperature=0, max_tokens=8)
            try:
                endpoint.check("m")
            except Exception as err:  # noqa: BLE001 - the message is what is checked
                shown.append(str(err))
            endpoint.close()
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert server.auth_headers  # the server was reached through the URL with credentials
    shown += [reply.error, reply.cause, caplog.text, log_file.read_text()]
    assert "http://***@127.0.0.1" in shown[0] and "HTTP Request" in log_file.read_text()
    for text in shown:
        assert password not in text and "alice:" not in text, text

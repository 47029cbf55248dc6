"""One redaction for every writer: secret keys, secret values of the environment, and every spelling of them."""

import json
from urllib.parse import quote, quote_plus

import pytest

from mmtune.io.secrets import MIN_SECRET_CHARS, Redactor, SecretError, clean_secret, environment_secrets, redact

KEY = "sk-test/SECRET+4f7a9c=="  # '/', '+' and '=' change under URL encoding


def _spellings(secret: str) -> dict[str, str]:
    """Messages that carry ``secret`` the ways libraries print it."""
    return {
        "plain": f"invalid key {secret}",
        "header repr": repr(f"Bearer {secret}\r".encode()),  # httpx: Illegal header value b'Bearer sk-...\r'
        "str repr": repr({"authorization": f"Bearer {secret}"}),
        "json": json.dumps({"error": f"key {secret} rejected"}),
        "json in json": json.dumps({"body": json.dumps({"error": f"key {secret}"})}),
        "url": f"https://proxy/?key={quote(secret, safe='')}",
        "url plus": f"https://proxy/?key={quote_plus(secret, safe='')}",
        "cut short": f"401 Unauthorized: Bearer {secret[:12]}",
        "cut before dots": f"header Bearer {secret[:10]}... (truncated)",
    }


@pytest.mark.parametrize("form", sorted(_spellings(KEY)))
def test_every_spelling_of_a_secret_is_hidden(form):
    message = _spellings(KEY)[form]
    hidden = Redactor([KEY]).text(message)
    assert "***" in hidden
    for piece in (KEY, quote(KEY, safe=""), quote_plus(KEY, safe=""), KEY[:10]):
        assert piece not in hidden, (form, hidden)


def test_text_around_a_secret_stays_and_short_values_are_ignored():
    assert Redactor([KEY]).text(f"a {KEY} b") == "a *** b"
    assert Redactor(["EMPTY"]).text("EMPTY key") == "EMPTY key"  # a local server's placeholder is no secret
    assert Redactor(["EMPTY"], min_chars=1).text("EMPTY key") == "*** key"  # unless the caller knows it is the key
    assert Redactor([]).text("nothing to hide") == "nothing to hide" and not Redactor([])
    assert Redactor([KEY]).text("sk-") == "sk-"  # a few characters of a key's public prefix are no secret


def test_redact_covers_secret_keys_and_values_interpolated_anywhere():
    env = {"MMTUNE_JUDGE_API_KEY": KEY + "\r\n", "MY_CRED": "hunter2-hunter2", "HOME": "/home/me", "PAD": "x"}
    config = {"run_name": f"run-{KEY}", "logging": {"tags": ["a", KEY]}, "judge": {"api_key": "sk-short"},
              "other": "hunter2-hunter2", "home": "/home/me", "steps": 3}
    out = redact(config, env=env, names=["MY_CRED"])
    assert out["run_name"] == "run-***" and out["logging"]["tags"] == ["a", "***"] and out["judge"]["api_key"] == "***"
    assert out["other"] == "***"  # a value of a variable named explicitly (judge.api_key_env may name any)
    assert out["home"] == "/home/me" and out["steps"] == 3  # HOME is no secret-named variable
    assert KEY not in json.dumps(out)


def test_environment_secrets_are_stripped_and_need_a_secret_name_or_an_explicit_one():
    env = {"OPENAI_API_KEY": " sk-abcdefgh\n", "HF_TOKEN": "hf_0123456789", "TOKENIZERS_PARALLELISM": "false",
           "CACHE_KEY": "0123456789", "SHORT_API_KEY": "abc", "LISTED": "listed-value"}
    assert sorted(environment_secrets(env, ["LISTED"])) == ["hf_0123456789", "listed-value", "sk-abcdefgh"]
    assert len("abc") < MIN_SECRET_CHARS


def test_clean_secret_strips_the_ends_and_refuses_inner_whitespace_naming_only_the_variable():
    assert clean_secret(f"  {KEY}\r\n", "MMTUNE_JUDGE_API_KEY") == KEY
    for bad, what in ((f"{KEY[:5]} {KEY[5:]}", "a space"), (f"{KEY[:5]}\n{KEY[5:]}", "line break"),
                      (f"{KEY[:5]}\x00{KEY[5:]}", "U+0000")):
        with pytest.raises(SecretError) as err:
            clean_secret(bad, "MMTUNE_JUDGE_API_KEY")
        assert "$MMTUNE_JUDGE_API_KEY" in str(err.value) and what in str(err.value)
        assert KEY[:5] not in str(err.value) and KEY[5:] not in str(err.value)


def test_the_lock_holder_record_shows_no_secret(tmp_path, monkeypatch):
    from mmtune.io.locks import lock_directory, read_holder

    monkeypatch.setenv("MMTUNE_JUDGE_API_KEY", KEY)
    monkeypatch.setattr("sys.argv", ["recipes/evaluate.py", f"run_name=run-{KEY}", "eval.judge.api_key=sk-inline-123"])
    with lock_directory(tmp_path / "out", purpose="evaluation"):
        command = read_holder(tmp_path / "out")["command"]
    assert "run_name=run-***" in command and "eval.judge.api_key=***" in command and KEY not in command


@pytest.mark.parametrize("url", [
    "http://user:pa55word-x@host:8000/v1",
    "https://user:pa55word-x@api.example.com/v1/chat/completions",
    "http://pa55word-x@host/v1",  # a token as the user name
    "http://user:pa55%40word-x@host/v1",  # a password holding an encoded "@"
    "HTTP://User:pa55word-x@HOST/v1",
])
def test_credentials_written_in_a_url_are_hidden_known_or_not(url):
    from mmtune.io.secrets import Redactor

    for text in (url, f"POST {url} \"HTTP/1.1 200 OK\"", json.dumps({"endpoint": url}), repr(url)):
        shown = Redactor().text(text)
        assert "pa55" not in shown and "***@" in shown, shown
    assert Redactor().value({"about": {"endpoint": url}})["about"]["endpoint"].count("***@") == 1


def test_a_url_variable_makes_its_password_a_secret_everywhere():
    from mmtune.io.secrets import environment_secrets, redact_text

    env = {"MMTUNE_GEN_BASE_URL": "http://alice:hunter2-long@127.0.0.1:8000/v1", "PLAIN": "http://host/v1"}
    assert "hunter2-long" in environment_secrets(env)
    basic = "YWxpY2U6aHVudGVyMi1sb25n"  # base64 of alice:hunter2-long, as an HTTP Basic header holds it
    shown = redact_text(f"password hunter2-long, header Basic {basic}, plain http://host/v1", env=env)
    assert "hunter2" not in shown and basic not in shown and "http://host/v1" in shown


def test_redact_logging_rewrites_every_handlers_records(tmp_path):
    import logging

    from mmtune.io.secrets import Redactor, redact_logging

    path = tmp_path / "job.log"
    handler = logging.FileHandler(path)
    root = logging.getLogger()
    root.addHandler(handler)
    logger = logging.getLogger("some.http.library")
    try:
        with redact_logging(Redactor(["sk-secret-value-1"])):
            logger.warning("HTTP Request: POST %s", "http://bob:pw-123456@h/v1/chat")
            try:
                raise RuntimeError("failed with key sk-secret-value-1")
            except RuntimeError:
                logger.exception("call failed")
        logger.warning("after: %s", "http://bob:pw-123456@h/v1")  # the filter is gone with the block
    finally:
        root.removeHandler(handler)
        handler.close()
    lines = path.read_text()
    inside, after = lines.split("after:")
    assert "pw-123456" not in inside and "sk-secret-value-1" not in inside and "http://***@h/v1/chat" in inside
    assert "RuntimeError" in inside  # the traceback is kept, redacted
    assert "pw-123456" in after

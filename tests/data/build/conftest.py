"""Fixtures for the builder tests: a loopback OpenAI-compatible teacher and a generated corpus.

The teacher answers from the prompt alone (no model): per-image prompts get pairs about
the caption, cross-image prompts pairs naming Image1..ImageN, summaries a fixed sentence.
Tests swap ``server.reply`` to script malformed replies, and read ``server.requests``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Optional

import pytest


def default_reply(prompt: str) -> str:
    """A well-formed teacher reply for one of the shipped prompt templates."""
    n_pairs = int(m.group(1)) if (m := re.search(r"Write (\d+) question", prompt)) else 1
    if "condense reference text" in prompt:
        return "A short factual summary of the entry."
    if m := re.search(r"named Image1 to Image(\d+)", prompt):
        n = int(m.group(1))
        pairs = [{"question": f"How do Image1 and Image{n} differ? ({i})",
                  "answer": f"Image1 and Image{n} show different shapes."} for i in range(n_pairs)]
        return json.dumps({"qa": pairs})
    caption = m.group(1).strip() if (m := re.search(r"caption: (.*)", prompt)) else "something"
    pairs = [{"question": f"What does the image show? ({i})", "answer": f"It shows {caption.split(',')[0]}."}
             for i in range(n_pairs)]
    return json.dumps({"qa": pairs})


class _Server(ThreadingHTTPServer):
    # The default listen backlog (5) drops connections when many clients connect at once.
    request_queue_size = 256
    daemon_threads = True


class FakeTeacher:
    """``/v1/chat/completions`` on 127.0.0.1 with scripted replies, latency and failures.

    Args:
        latency_s: sleep before each answer.
        fail_after: answer HTTP 500 to every request after this many successful ones.
    """

    def __init__(self, latency_s: float = 0.0, fail_after: Optional[int] = None):
        self.latency_s = latency_s
        self.fail_after = fail_after
        self.reply: Callable[[str], str] = default_reply
        self.requests: list[dict] = []
        self.served = 0
        self._lock = threading.Lock()
        teacher = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def log_message(self, *args):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                status, payload = teacher._answer(body, self.headers)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = _Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def env(self, model: str = "fake-teacher") -> dict[str, str]:
        return {"MMTUNE_TEACHER_BASE_URL": self.base_url, "MMTUNE_TEACHER_MODEL": model}

    def _answer(self, body: dict, headers) -> tuple[int, dict]:
        if self.latency_s:
            time.sleep(self.latency_s)
        msg = body["messages"][-1]["content"]
        prompt = msg if isinstance(msg, str) else "".join(p.get("text", "") for p in msg if p.get("type") == "text")
        n_images = 0 if isinstance(msg, str) else sum(p.get("type") == "image_url" for p in msg)
        with self._lock:
            self.requests.append({"prompt": prompt, "images": n_images, "auth": headers.get("Authorization", "")})
            if self.fail_after is not None and self.served >= self.fail_after:
                return 500, {"error": {"message": "scripted failure"}}
            self.served += 1
        content = self.reply(prompt)
        return 200, {
            "id": "cmpl-fake", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(content) // 4,
                      "total_tokens": (len(prompt) + len(content)) // 4},
        }

    def __enter__(self) -> "FakeTeacher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def teacher():
    with FakeTeacher() as server:
        yield server


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    from mmtune.data.build.demo_corpus import generate_corpus

    return generate_corpus(tmp_path / "corpus", entries=24, images_per_entry=2, image_size=56, seed=0)


@pytest.fixture
def make_cfg(tmp_path: Path, corpus: Path):
    """``make_cfg(**overrides)``: a validated BuildConfig on the generated corpus (hashing embedder)."""
    from omegaconf import OmegaConf

    from mmtune.data.build.config import BuildConfig

    def make(*dotlist: str, out: Optional[Path] = None):
        base = OmegaConf.structured(BuildConfig)
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist([
            f"corpus.path={corpus}", f"output.dir={out or tmp_path / 'out'}", "embed.kind=hashing",
            "cluster.threshold=0.6", "sets.min_images=2", "sets.max_images=3", "teacher.concurrency=4",
            "teacher.max_retries=0", "prompts.per_image_pairs=1", "prompts.cross_image_pairs=2", *dotlist,
        ]))
        built = OmegaConf.to_object(cfg)
        built.validate()
        return built

    return make

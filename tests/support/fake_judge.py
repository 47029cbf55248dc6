"""A loopback OpenAI-compatible chat server with scripted replies, for tests and benchmarks.

Test tooling, deliberately outside the installed package. Tests import it as
``tests.support.fake_judge``; scripts under ``bench/`` put the repository root on
``sys.path`` first.

It implements ``POST /v1/chat/completions`` only. A ``responder`` callable maps each
request body to a :class:`Scripted` reply (content, HTTP status, raw garbage body,
delay, a streamed body of any size with any framing), so tests can inject 429s, 500s,
timeouts, malformed and oversized bodies and count calls and bytes sent.
It never checks the key; it records the Authorization header only so tests can assert
where the key did (and did not) travel. It is bounded: past ``max_requests`` requests it
answers 503 (so a client in a retry loop cannot hammer it), and after ``lifetime_s``
seconds it shuts itself down, so a test that hangs never leaves it behind.

Example::

    with FakeJudgeServer(lambda body: Scripted("{'Overall Score': 7}")) as server:
        os.environ["MMTUNE_JUDGE_BASE_URL"] = server.base_url
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterable, Optional

__all__ = ["Scripted", "FakeJudgeServer"]


@dataclass
class Scripted:
    content: str = ""
    status: int = 200
    raw: Optional[bytes] = None
    """Body sent verbatim instead of a chat completion (malformed-reply tests)."""
    delay_s: float = 0.0
    headers: Optional[dict[str, str]] = None
    trickle_s: float = 0.0
    """Send the whole response (status line, headers, body) one byte at a time, this many
    seconds apart: a server that never lets a single read time out. It stops when the
    response is out or the client hangs up (counted in ``FakeJudgeServer.cut_off``)."""
    finish_reason: str = "stop"
    stream: Optional[Callable[[], Iterable[bytes]]] = None
    """Body sent chunk by chunk from this iterable instead (a huge or endless body); the
    server stops at :data:`STREAM_LIMIT` bytes or when the client hangs up."""
    framing: str = "length"
    """How a ``stream`` body is delimited: ``length`` (``Content-Length: declared``),
    ``chunked`` (chunked transfer encoding) or ``close`` (no length: the body ends when
    the connection closes); ``headers`` sends the chunks as header lines instead, headers
    that never end."""
    declared: Optional[int] = None
    """The ``Content-Length`` sent with ``framing="length"``."""


STREAM_LIMIT = 256 * 1024 * 1024
"""Most bytes one streamed body sends before the server gives up (keeps tests bounded)."""


class FakeJudgeServer:
    def __init__(self, responder: Callable[[dict[str, Any]], Scripted], *, port: int = 0,
                 max_requests: int = 100_000, lifetime_s: float = 900.0):
        self.responder = responder
        self.max_requests = max_requests
        self.lifetime_s = lifetime_s
        self.requests: list[dict[str, Any]] = []
        self.auth_headers: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.cut_off = 0
        """Trickled or streamed responses the client hung up on before their last byte."""
        self.streamed: list[int] = []
        """Body bytes written of each streamed response (the client may have read fewer)."""
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # headers and body go out in two writes; with Nagle on, the delayed ACK on
            # loopback adds ~40 ms to every reply and the server would measure itself
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server API)
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with server._lock:
                    server.requests.append(body)
                    server.auth_headers.append(self.headers.get("Authorization", ""))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                try:
                    over = len(server.requests) > server.max_requests
                    reply = Scripted("request budget of the test server exhausted", status=503) if over \
                        else server.responder(body)
                    if reply.delay_s:
                        time.sleep(reply.delay_s)
                    if reply.raw is not None:
                        payload = reply.raw
                    elif reply.status == 200:
                        prompt_text = json.dumps(body.get("messages", []))
                        payload = json.dumps(
                            {
                                "id": "chatcmpl-fake",
                                "object": "chat.completion",
                                "created": int(time.time()),
                                "model": body.get("model", "fake"),
                                "choices": [
                                    {
                                        "index": 0,
                                        "finish_reason": reply.finish_reason,
                                        "message": {"role": "assistant", "content": reply.content},
                                    }
                                ],
                                "usage": {
                                    "prompt_tokens": len(prompt_text) // 4,
                                    "completion_tokens": max(1, len(reply.content) // 4),
                                    "total_tokens": len(prompt_text) // 4 + max(1, len(reply.content) // 4),
                                },
                            }
                        ).encode()
                    else:
                        payload = json.dumps({"error": {"message": reply.content or "scripted error"}}).encode()
                    if reply.trickle_s:
                        self._trickle(reply, payload)
                        return
                    if reply.stream is not None:
                        self._stream(reply)
                        return
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    for name, value in (reply.headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    try:
                        self.wfile.write(payload)
                    except (BrokenPipeError, ConnectionResetError):  # client timed out first
                        pass
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _stream(self, reply: Scripted) -> None:
                self.close_connection = True
                self.send_response(reply.status)
                if reply.framing == "headers":
                    self._endless_headers(reply)
                    return
                # the handler closes after this reply; HTTP/1.1 asks a closing server to say so, or a
                # client reusing the connection races the close ("Server disconnected without ...")
                self.send_header("Connection", "close")
                self.send_header("Content-Type", "application/json")
                if reply.framing == "length":
                    self.send_header("Content-Length", str(reply.declared))
                elif reply.framing == "chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                for name, value in (reply.headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                sent = 0
                try:
                    for chunk in reply.stream():
                        if sent >= STREAM_LIMIT:
                            break
                        framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if reply.framing == "chunked" else chunk
                        self.wfile.write(framed)
                        sent += len(chunk)
                    if reply.framing == "chunked":
                        self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    with server._lock:
                        server.cut_off += 1
                finally:
                    with server._lock:
                        server.streamed.append(sent)

            def _endless_headers(self, reply: Scripted) -> None:
                self.flush_headers()
                sent = 0
                try:
                    for chunk in reply.stream():
                        if sent >= STREAM_LIMIT:
                            break
                        self.wfile.write(b"X-Padding: " + chunk[:4000] + b"\r\n")
                        sent += len(chunk[:4000]) + 13
                except (BrokenPipeError, ConnectionResetError):
                    with server._lock:
                        server.cut_off += 1
                finally:
                    with server._lock:
                        server.streamed.append(sent)

            def _trickle(self, reply: Scripted, payload: bytes) -> None:
                head = (f"HTTP/1.1 {reply.status} Scripted\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(payload)}\r\n\r\n").encode()
                self.close_connection = True
                data = head + payload
                for i in range(len(data)):
                    try:
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                    except (BrokenPipeError, ConnectionResetError):
                        with server._lock:
                            server.cut_off += 1
                        return
                    time.sleep(reply.trickle_s)

        self._stopped = False
        self._timer: Optional[threading.Timer] = None
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def prompts(self) -> list[str]:
        """The last user message text of every request received, in arrival order."""
        out = []
        for body in self.requests:
            content = body["messages"][-1]["content"]
            out.append(content if isinstance(content, str) else content[0]["text"])
        return out

    def start(self) -> "FakeJudgeServer":
        self._thread.start()
        self._timer = threading.Timer(self.lifetime_s, self.stop)
        self._timer.daemon = True
        self._timer.start()
        return self

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "FakeJudgeServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

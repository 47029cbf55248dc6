"""A served multi-turn vision-language model on loopback that checks every request it gets.

Test tooling (see :mod:`tests.support.fake_judge`, whose bounded server it runs behind).
Given the dialogues being evaluated, :class:`CheckingModel` answers each chat request
with ``answer(dialogue, turn)`` and records a problem whenever a request is not exactly
what the protocol asks for:

* the messages are the optional system message, then every user turn of the dialogue so
  far in order, each followed by the answer this server gave to it (the model's OWN
  answers, not the references), then the question being asked;
* each user turn's text parts are its text segments, in order, and its image parts are
  data URLs of its images, in place: every image introduced so far is there, decoded to
  the file's pixels (or, when ``max_side`` is given, to the file downscaled to fit it);
* the decoding fields equal ``expect`` (``temperature``, ``max_tokens`` ...).

Example::

    model = CheckingModel(dialogues, expect={"temperature": 0.0, "max_tokens": 8})
    with model.serve() as server:
        ...  # generate with base URL server.base_url
    assert model.problems == [] and model.asked == expected_turns
"""

from __future__ import annotations

import base64
import io
import threading
from typing import Any, Callable, Optional, Sequence

from tests.support.fake_judge import FakeJudgeServer, Scripted

__all__ = ["CheckingModel", "default_answer"]


def default_answer(dialogue_id: str, turn: int) -> str:
    return f"answer of {dialogue_id} turn {turn}"


class CheckingModel:
    """A responder for :class:`FakeJudgeServer` that plays a model and audits each request.

    Args:
        dialogues: the :class:`mmtune.data.dialogue.Dialogue` objects being evaluated
            (their first questions tell the dialogues apart).
        expect: request fields and the values they must have.
        answer: ``(dialogue id, turn) -> reply`` (a :class:`Scripted` for errors, delays).
        max_side: images larger than this are expected downscaled to fit.
        system: the system message expected first (``None``: none).
    """

    def __init__(self, dialogues: Sequence[Any], *, expect: Optional[dict[str, Any]] = None,
                 answer: Callable[[str, int], Any] = default_answer, max_side: Optional[int] = None,
                 system: Optional[str] = None):
        self.dialogues = {d.turns[next(iter(d.exchanges()))[0]].text: d for d in dialogues}
        self.expect = dict(expect or {})
        self.answer = answer
        self.max_side = max_side
        self.system = system
        self.problems: list[str] = []
        self.asked: list[tuple[str, int]] = []
        """(dialogue id, turn) of every request, in arrival order."""
        self.given: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()

    def serve(self, **server: Any) -> FakeJudgeServer:
        return FakeJudgeServer(self, **server)

    def _problem(self, text: str) -> None:
        with self._lock:
            self.problems.append(text)

    def __call__(self, body: dict[str, Any]) -> Scripted:
        messages = list(body.get("messages", []))
        for key, value in self.expect.items():
            if body.get(key) != value:
                self._problem(f"{key}={body.get(key)!r}, expected {value!r}")
        if self.system is not None:
            if not messages or messages[0] != {"role": "system", "content": self.system}:
                self._problem(f"first message {messages[:1]} is not the system prompt {self.system!r}")
            messages = messages[1:]
        elif messages and messages[0].get("role") == "system":
            self._problem(f"unexpected system message {messages[0]}")
            messages = messages[1:]
        first = _text(messages[0]["content"]) if messages else ""
        dialogue = self.dialogues.get(first)
        if dialogue is None:
            self._problem(f"a request whose first question {first!r:.60} is no dialogue's")
            return Scripted("?")
        exchanges = list(dialogue.exchanges())
        t = (len(messages) - 1) // 2
        roles = [m["role"] for m in messages]
        if len(messages) % 2 == 0 or roles != ["user", "assistant"] * t + ["user"] or t >= len(exchanges):
            self._problem(f"{dialogue.id}: roles {roles} are not user/assistant turns ending with a question")
            return Scripted("?")
        for j in range(t + 1):
            self._check_user(dialogue.id, j, dialogue.turns[exchanges[j][0]], messages[2 * j]["content"])
            if j < t:
                with self._lock:
                    given = self.given.get((dialogue.id, j))
                if messages[2 * j + 1]["content"] != given:
                    self._problem(f"{dialogue.id} turn {t}: history answer {j} is {messages[2 * j + 1]['content']!r}, "
                                  f"the model answered {given!r}")
        with self._lock:
            self.asked.append((dialogue.id, t))
        reply = self.answer(dialogue.id, t)
        reply = reply if isinstance(reply, Scripted) else Scripted(reply)
        if reply.status == 200:
            # a raw or streamed body carries no text the client can keep: its history holds ""
            with self._lock:
                self.given[(dialogue.id, t)] = reply.content.strip() if reply.raw is None and reply.stream is None else ""
        return reply

    def _check_user(self, dialogue_id: str, j: int, turn: Any, content: Any) -> None:
        from PIL import Image as PILImage

        where = f"{dialogue_id} user turn {j}"
        if not turn.images:
            if content != turn.text:
                self._problem(f"{where}: {content!r} is not {turn.text!r}")
            return
        if not isinstance(content, list):
            self._problem(f"{where}: has images but its content is {type(content).__name__}")
            return
        expected = [s for s in turn.segments if not isinstance(s, str) or s]
        if len(content) != len(expected):
            self._problem(f"{where}: {len(content)} parts for {len(expected)} segments")
            return
        for part, segment in zip(content, expected):
            if isinstance(segment, str):
                if part != {"type": "text", "text": segment}:
                    self._problem(f"{where}: part {part!r:.80} is not the text {segment!r}")
                continue
            url = (part.get("image_url") or {}).get("url", "") if part.get("type") == "image_url" else ""
            if not url.startswith("data:image/"):
                self._problem(f"{where}: {segment.path} is not sent as a data URL ({part!r:.80})")
                continue
            sent = PILImage.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
            with PILImage.open(segment.path) as original:
                want = original.convert("RGB")
            if self.max_side is not None and max(want.size) > self.max_side:
                scale = self.max_side / max(want.size)
                size = (max(1, round(want.size[0] * scale)), max(1, round(want.size[1] * scale)))
                if sent.size != size:
                    self._problem(f"{where}: {segment.path} sent at {sent.size}, expected downscaled to {size}")
                continue
            if sent.size != want.size or sent.tobytes() != want.tobytes():
                self._problem(f"{where}: the image sent for {segment.path} is not that file's pixels")


def _text(content: Any) -> str:
    """The text of a user message (its text parts joined), to tell dialogues apart."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")

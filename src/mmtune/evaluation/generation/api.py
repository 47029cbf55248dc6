"""The ``api`` generation backend: dialogues answered by a model behind an OpenAI-compatible endpoint.

``eval.generation.backend: api`` evaluates a model mmtune does not load: GPT-4o-class
models for the closed-model rows, or any model vLLM or SGLang serve (their prefix
caching reuses each dialogue's history across turns). The protocol is the local
generator's: turns are asked in order, each request holding every earlier user turn
with its images, the model's OWN earlier answers (not the references) and the new
question. Images go as data URLs, capped (``max_image_side``, ``max_image_mb``):
downscaled to fit or refused, as ``oversize`` says; a downscaled image is named in the
turn's record.

Calls go through :class:`~mmtune.evaluation.chat_api.ChatEndpoint`, the judge's: the
endpoint and key from environment variables, retries with backoff, the key redacted,
tokens and cost counted. ``concurrency`` dialogues are in flight at once (a dialogue's
turns depend on each other, so they are asked one after the other).

Records are those of the local generator, in the same resumable file
(:class:`~mmtune.evaluation.generation.records.GenerationsFile`): settings (decoding,
served model, image caps) keyed in ``<file>.settings.json`` (the base URL is recorded
there too, not compared: a restarted server on another port serves the same model), finished turns
skipped on resume. A turn whose call still fails after retries, or whose reply is larger
than the byte cap (:func:`~mmtune.evaluation.chat_api.reply_cap`), is recorded with
``finish_reason: "error"`` and its ``error``; the dialogue's later turns are not asked
(their history would lack that answer) and are recorded the same way. An answer that is
empty, null or not text is recorded as given (``""``), with an ``error`` naming which.
Every record with an ``error`` says its ``kind`` and counts against ``max_failed_share``
(:func:`~mmtune.evaluation.generation.records.check_failed_turns`); a re-run asks each such
turn again, and the later turns of its dialogue with it (their history changes).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

from mmtune.data.dialogue import Dialogue, Image
from mmtune.evaluation.chat_api import (SERVED_MODEL, CallStats, ChatEndpoint, ImageRefused, ImageTooLarge,
                                       image_data_url)
from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.records import FAILED, GenerationsFile, TurnRecord, question_text

__all__ = ["ApiGenerator", "ApiStats", "dialogue_messages"]


@dataclass
class ApiStats(CallStats):
    """Calls of one :meth:`ApiGenerator.generate` (see :class:`~mmtune.evaluation.chat_api.CallStats`)."""

    label: ClassVar[str] = "generation"


def dialogue_messages(dialogue: Dialogue, t: int, answers: Sequence[Optional[str]], *, system_prompt: Optional[str],
                      image_url: Callable[[Image], str]) -> list[dict[str, Any]]:
    """The chat messages that ask exchange ``t`` of ``dialogue``.

    Every earlier user turn with its images in place, the model's own ``answers`` to them,
    then the question of exchange ``t``. A user turn with images is a list of ``text`` and
    ``image_url`` parts in the order of its segments; a text-only turn a plain string.

    Args:
        system_prompt: ``None``: the dialogue's own system turn, if any; ``""``: none; else
            this text.
        image_url: an image segment -> the URL sent for it (a data URL).
    """
    messages: list[dict[str, Any]] = []
    system = system_prompt
    if system is None and dialogue.turns and dialogue.turns[0].role == "system":
        system = dialogue.turns[0].text
    if system:
        messages.append({"role": "system", "content": system})
    exchanges = list(dialogue.exchanges())
    for j in range(t + 1):
        turn = dialogue.turns[exchanges[j][0]]
        if turn.images:
            parts: list[dict[str, Any]] = []
            for segment in turn.segments:
                if isinstance(segment, str):
                    if segment:
                        parts.append({"type": "text", "text": segment})
                else:
                    parts.append({"type": "image_url", "image_url": {"url": image_url(segment)}})
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": "user", "content": turn.text})
        if j < t:
            messages.append({"role": "assistant", "content": answers[j] or ""})
    return messages


class ApiGenerator:
    """Answers dialogues turn by turn with a served model (``eval.generation.api``).

    Args:
        config: the ``eval.generation`` settings (decoding and its ``api`` section).
        env: environment to read the endpoint and key from (``os.environ`` by default).
        sleep, rng: backoff waits and their jitter (tests inject them).

    Raises:
        ValueError: ``api.model`` is not set.
    """

    def __init__(self, config: GenerationConfig, *, env: Optional[dict[str, str]] = None,
                 sleep: Callable[[float], None] = time.sleep, rng: Optional[random.Random] = None):
        api = config.api
        if not api.model:
            raise ValueError("eval.generation.backend=api needs eval.generation.api.model: the served model's name as "
                             "the endpoint knows it (e.g. gpt-4o-2024-05-13, or the model given to `vllm serve`)")
        self.config = config
        self.stats = ApiStats()
        self.endpoint = ChatEndpoint(api, env=os.environ if env is None else env, role=SERVED_MODEL, stats=self.stats,
                                     rng=rng)
        self.context_length = config.context_length
        """The window is the server's; ``context_length`` is only recorded."""
        self._sleep = sleep
        self._lock = threading.Lock()

    def describe(self) -> str:
        """The start-up line: served model, endpoint and where each came from; never the key."""
        api = self.config.api
        return (f"generation: served model {api.model!r} at {self.endpoint.where()}; {api.concurrency} dialogues at "
                f"once; failures allowed: {100 * api.max_failed_share:g}% of turns")

    def usage(self) -> dict[str, Any]:
        """Calls, tokens and estimated cost of the last :meth:`generate`."""
        return self.stats.to_dict()

    def _settings(self, run_key: Optional[dict[str, Any]]) -> dict[str, Any]:
        cfg, api = self.config, self.config.api
        keys = ("max_new_tokens", "do_sample", "temperature", "top_p", "repetition_penalty", "seed", "system_prompt")
        settings: dict[str, Any] = {k: getattr(cfg, k) for k in keys}
        settings.update(backend="api", model=api.model, max_image_side=api.max_image_side,
                        max_image_mb=api.max_image_mb, oversize=api.oversize)
        settings.update(run_key or {})
        # the endpoint describes the run; a restarted server at another port serves the same model
        settings["about"] = {**settings.get("about", {}), "endpoint": self.endpoint.shown_url}
        return settings

    def _decoding(self) -> tuple[float, dict[str, Any]]:
        """(temperature, further request fields): greedy is temperature 0."""
        cfg = self.config
        extra: dict[str, Any] = {}
        if not cfg.do_sample:
            return 0.0, extra
        if cfg.top_p < 1.0:
            extra["top_p"] = cfg.top_p
        extra["seed"] = cfg.seed
        if cfg.repetition_penalty != 1.0:  # not an OpenAI field: vLLM and SGLang read it from the body
            extra["repetition_penalty"] = cfg.repetition_penalty
        return cfg.temperature, extra

    def generate(self, dialogues: Sequence[Dialogue], *, out_path: Optional[str | os.PathLike] = None,
                 progress: bool = False, run_key: Optional[dict[str, Any]] = None,
                 resume_from: Sequence[str | os.PathLike] = ()) -> list[TurnRecord]:
        """Answer every user turn of ``dialogues``, ``api.concurrency`` dialogues at a time;
        append each record to ``out_path`` at once (see
        :meth:`~mmtune.evaluation.generation.generator.DialogueGenerator.generate`).

        Returns:
            All records of ``dialogues`` (old and new), in dialogue and turn order.
        """
        from tqdm.auto import tqdm

        self.stats = self.endpoint.stats = ApiStats()
        file = None
        done: dict[tuple[str, int], dict[str, Any]] = {}
        if out_path is not None:
            file = GenerationsFile(out_path, self._settings(run_key), dialogues, resume_from=resume_from)
            done = _answered_prefixes(file.done, dialogues)
        records: dict[tuple[str, int], TurnRecord] = {k: TurnRecord(**v) for k, v in done.items()}
        pending = {d.id: sum((d.id, t) not in done for t in range(len(list(d.exchanges())))) for d in dialogues}
        # Dialogues with the most turns left go first, so the last ones to run while other
        # slots sit idle are short (a dialogue's turns are asked one after the other).
        todo = sorted((d for d in dialogues if pending[d.id]), key=lambda d: -pending[d.id])
        bar = tqdm(total=sum(pending.values()), desc="generating (api)", disable=not progress)
        stop = threading.Event()

        def emit(record: TurnRecord) -> None:
            with self._lock:
                records[(record.dialogue_id, record.turn)] = record
                if file is not None:
                    file.append(record)
                bar.update(1)

        try:
            if todo:
                with ThreadPoolExecutor(max_workers=max(1, min(self.config.api.concurrency, len(todo)))) as pool:
                    futures = [pool.submit(self._answer, d, done, emit, stop) for d in todo]
                    errors = []
                    for future in futures:
                        try:
                            future.result()
                        except BaseException as err:  # noqa: BLE001 - the first error is raised after the others stop
                            stop.set()
                            errors.append(err)
                if errors:
                    raise errors[0]
        except BaseException:
            if file is not None:
                file.close()  # the lock goes with it; a finished run's file is closed by finish()
            raise
        finally:
            bar.close()
        order = [(d.id, t) for d in dialogues for t in range(len(list(d.exchanges())))]
        if file is not None:
            file.finish(order)
        return [records[k] for k in order if k in records]

    def _answer(self, dialogue: Dialogue, done: dict[tuple[str, int], dict[str, Any]], emit: Callable[[TurnRecord], None],
                stop: threading.Event) -> None:
        """Ask the turns of ``dialogue`` that are not done, in order."""
        api = self.config.api
        exchanges = list(dialogue.exchanges())
        answers: list[Optional[str]] = [None] * len(exchanges)
        for t in range(len(exchanges)):
            if (dialogue.id, t) in done:
                answers[t] = done[(dialogue.id, t)]["answer"]
        urls: dict[str, str] = {}
        notes: dict[str, str] = {}
        temperature, extra = self._decoding()
        failed: Optional[int] = None

        def image_url(image: Image) -> str:
            path = image.path
            if path not in urls:  # read once per dialogue, inside its root, at the moment it is read
                max_bytes = int(api.max_image_mb * 1e6) if api.max_image_mb else None
                urls[path], note = image_data_url(
                    path, max_side=api.max_image_side, max_bytes=max_bytes, oversize=api.oversize,
                    setting="eval.generation.api.max_image_side", receiver="the served model",
                    remedy="Fix the image path in the benchmark data", root=image.root)
                if note:
                    notes[path] = note
            return urls[path]

        for t, (u, a) in enumerate(exchanges):
            if (dialogue.id, t) in done:
                continue
            if stop.is_set():
                return
            question = question_text(dialogue.turns[u])
            reference = dialogue.turns[a].text if a < len(dialogue.turns) else None
            if failed is not None:
                emit(TurnRecord(dialogue.id, t, question, None, reference, 0, 0, 0, FAILED,
                                error={"status": None, "message": f"not asked: turn {failed} of this dialogue failed",
                                       "kind": "not_asked"}))
                continue
            try:
                messages = dialogue_messages(dialogue, t, answers, system_prompt=self.config.system_prompt,
                                             image_url=image_url)
            except ImageRefused as err:
                failed = t
                with self._lock:
                    self.stats.requests += 1
                reply = self.endpoint.fail(str(err), None, "image")
                cause = ("an image above the size cap" if isinstance(err, ImageTooLarge)
                         else "an image file that lies outside its image root when opened")
                emit(TurnRecord(dialogue.id, t, question, None, reference, 0, 0, 0, FAILED,
                                error={"status": None, "message": reply.error, "cause": cause, "kind": "image"}))
                continue
            with self._lock:
                self.stats.requests += 1
            reply = self.endpoint.complete(api.model, messages, temperature=temperature,
                                           max_tokens=self.config.max_new_tokens, extra=extra, sleep=self._sleep)
            sent = [img.path for j in range(t + 1) for img in dialogue.turns[exchanges[j][0]].images]
            context = {"downscaled": {p: notes[p] for p in sent if p in notes}} if any(p in notes for p in sent) else None
            if not reply.ok:
                failed = t
                emit(TurnRecord(dialogue.id, t, question, None, reference, 0, 0, 0, FAILED, context,
                                error={"status": reply.status, "message": reply.error, "cause": reply.cause,
                                       "kind": reply.kind or "call"}))
                continue
            answer = reply.content.strip()
            answers[t] = answer
            error = None
            if reply.unreadable is not None:
                error = {"status": None, "message": reply.unreadable, "kind": reply.kind,
                         "cause": "the server answered without text (a refusal, a tool call or a broken server)"}
            elif not answer:
                error = {"status": None, "message": "the served model answered with an empty text", "kind": "empty",
                         "cause": "the model gave no answer (check the chat template and max_new_tokens)"}
            finish = "length" if reply.finish_reason == "length" else "stop"
            emit(TurnRecord(dialogue.id, t, question, answer, reference, reply.prompt_tokens,
                            reply.prompt_tokens + reply.completion_tokens, reply.completion_tokens, finish, context,
                            error=error))

    def close(self) -> None:
        self.endpoint.close()


def _answered_prefixes(done: dict[tuple[str, int], dict[str, Any]],
                       dialogues: Sequence[Dialogue]) -> dict[tuple[str, int], dict[str, Any]]:
    """The finished turns a resumed run keeps: per dialogue, those before its first turn
    that is not finished. A turn after one asked again was answered with another history
    (the earlier answer was missing, empty or not text), so it is asked again too."""
    kept: dict[tuple[str, int], dict[str, Any]] = {}
    for dialogue in dialogues:
        for t in range(len(list(dialogue.exchanges()))):
            if (dialogue.id, t) not in done:
                break
            kept[(dialogue.id, t)] = done[(dialogue.id, t)]
    return kept


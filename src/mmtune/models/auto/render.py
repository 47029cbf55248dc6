"""Stage 2: the chat template's rendering of a dialogue, cut into spans.

A span is a character range of the rendered text: a turn's header, its (trainable) content,
or, after :mod:`.image_text` expands them, an image. See the package doc for the rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from mmtune.core.dialogue import Image
from mmtune.models.auto.errors import TemplateNotPrefixStableError

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.core.dialogue import Dialogue

__all__ = ["RenderStage", "Span", "common_prefix"]


@dataclass
class Span:
    """A character span of the expanded text: a turn's header / content part, or an image."""

    start: int
    end: int
    turn: int  # -1: the generation prompt
    trainable: bool = False
    image: Image | None = None



def common_prefix(a: str, b: str, start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, known to be at least ``start``."""
    n = min(len(a), len(b))
    k = start
    while k < n and a[k] == b[k]:
        k += 1
    return k



class RenderStage:
    """Rendering into spans (mixed into the adapter: needs ``chat_template``, ``tokenizer``, ``config``)."""

    # -- rendering -------------------------------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        # what processor.apply_chat_template(tokenize=False) renders, without its per-call set-up
        # (the length pass renders every prefix of every dialogue)
        from transformers.utils.chat_template_utils import render_jinja_template

        prompts, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           **self.tokenizer.special_tokens_map)
        return prompts[0]

    @staticmethod
    def _message(role: str, segments: Sequence[Any]) -> dict:
        content = [
            {"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s} for s in segments if s != ""
        ]
        # a message with nothing (an empty answer) keeps one empty text item: templates index the
        # first item (Idefics3's), and an empty text renders as nothing
        return {"role": role, "content": content or [{"type": "text", "text": ""}]}

    def _extends(self, dialogue_id: str, turn: int, before: str, after: str, what: str) -> None:
        if not after.startswith(before):
            k = common_prefix(before, after)
            raise TemplateNotPrefixStableError(
                f"dialogue {dialogue_id!r}, turn {turn}: the chat template of {self.config.path!r} is not "
                f"prefix-stable: adding {what} changes character {k} ({before[max(0, k - 20):k + 20]!r} -> "
                f"{after[max(0, k - 20):k + 20]!r}). Labels cannot be derived from it; use a template that renders "
                "earlier turns identically, or a family adapter."
            )

    def _spans(self, dialogue: "Dialogue", system_prompt: str | None, train_on: str,
               add_generation_prompt: bool) -> tuple[str, list[Span], int]:
        """The rendered text, its spans (turn parts in order) and the index of the first turn.

        Each turn's part is what rendering it adds to the render of the turns before it. That is
        computed on a window (the system message and the one or two turns before the turn, so
        that roles keep their parity) where the template renders turns locally (checked once per
        checkpoint on probe dialogues, :attr:`_windows_match`), and the joined parts are checked
        against the render of the whole dialogue; otherwise, or on any difference, every prefix
        of the dialogue is rendered (quadratic in the turns, same result)."""
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns = list(dialogue.turns)
        messages: list[dict] = []
        if turns and turns[0].role == "system":
            messages.append(self._message("system", turns[0].segments))
            turns = turns[1:]
        elif system_prompt:
            messages.append(self._message("system", (system_prompt,)))
        offset = 1 if dialogue.turns and dialogue.turns[0].role == "system" else 0
        head = len(messages)
        messages += [self._message(t.role, t.segments) for t in turns]
        roles = [t.role for t in turns]
        trainable = self._trainable(roles, train_on)
        found = None
        if not self._prefix_stable:
            found = self._spans_by_whole(dialogue.id, messages, head, roles, trainable, offset, add_generation_prompt)
        elif self._windows_match:
            found = self._spans_by_window(messages, head, roles, trainable, add_generation_prompt)
        if found is None:
            found = self._spans_by_prefix(dialogue.id, messages, head, roles, trainable, offset,
                                          add_generation_prompt)
        return (*self._with_text_change(*found), offset)

    def _with_text_change(self, text: str, spans: list[Span]) -> tuple[str, list[Span]]:
        """``text`` with what the processor's own call adds (:attr:`_text_change`), the first span
        grown to hold an added prefix. Raises where the processor adds a suffix (no class does)."""
        prefix, suffix = self._text_change
        if suffix:
            raise TemplateNotPrefixStableError(
                f"the processor of {self.config.path!r} appends {suffix!r} to every text it is given; mmtune "
                "cannot place that in a dialogue's turns: save the processor without that setting")
        if not prefix or text.startswith(prefix):
            return text, spans
        moved = [Span(s.start + len(prefix), s.end + len(prefix), s.turn, s.trainable, s.image) for s in spans]
        if moved:
            moved[0].start = 0
        return prefix + text, moved

    @staticmethod
    def _trainable(roles: list[str], train_on: str) -> list[bool]:
        last_assistant = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
        return [role == "assistant" and (train_on == "all_assistant" or i == last_assistant)
                for i, role in enumerate(roles)]

    def _spans_by_prefix(self, dialogue_id: str, messages: list[dict], head: int, roles: list[str],
                         trainable: list[bool], offset: int,
                         add_generation_prompt: bool) -> tuple[str, list[Span]]:
        """Spans from the render of every prefix of the dialogue (the definition)."""
        spans: list[Span] = []
        text = ""
        for index, role in enumerate(roles):
            where = index + offset
            if role not in ("user", "assistant"):
                raise ValueError(f"dialogue {dialogue_id!r}, turn {where}: role {role!r} is not allowed here")
            full = self._render(messages[: head + index + 1], add_generation_prompt=False)
            self._extends(dialogue_id, where, text, full, f"turn {where}")
            if role == "assistant":
                header = self._render(messages[: head + index], add_generation_prompt=True)
                self._extends(dialogue_id, where, text, header, "the generation prompt")
                body = common_prefix(header, full, len(text))
                spans += [Span(len(text), body, index), Span(body, len(full), index, trainable[index])]
            else:
                spans.append(Span(len(text), len(full), index))
            text = full
        if add_generation_prompt:
            if not roles or roles[-1] != "user":
                raise ValueError(
                    f"dialogue {dialogue_id!r}: add_generation_prompt needs the dialogue to end with a user turn"
                )
            prompt = self._render(messages, add_generation_prompt=True)
            self._extends(dialogue_id, offset + len(roles), text, prompt, "the generation prompt")
            spans.append(Span(len(text), len(prompt), -1))
            text = prompt
        return text, spans

    def _spans_by_window(self, messages: list[dict], head: int, roles: list[str], trainable: list[bool],
                         add_generation_prompt: bool) -> tuple[str, list[Span]] | None:
        """The spans of :meth:`_spans_by_prefix` from renders of a bounded number of turns each,
        or ``None`` where they cannot be shown equal (then the caller renders every prefix, which
        also raises the errors of a bad dialogue as the definition does)."""
        if any(role not in ("user", "assistant") for role in roles):
            return None
        if add_generation_prompt and (not roles or roles[-1] != "user"):
            return None
        renders: dict[tuple[int, int, bool], str] = {}

        def render(lo: int, hi: int, generation: bool) -> str:  # system message + turns[lo:hi]
            key = (lo, hi, generation)
            if key not in renders:
                renders[key] = self._render(messages[:head] + messages[head + lo:head + hi], generation)
            return renders[key]

        spans: list[Span] = []
        pieces: list[str] = []
        length = 0
        try:
            for index, role in enumerate(roles):
                # windows of _WINDOW turns (even: the template sees the roles at their parity); the
                # render before a turn is then the one that ended the turn before it
                lo = (index - 1) // self._WINDOW * self._WINDOW if index else 0
                base = render(lo, index, False) if index else ""
                full = render(lo, index + 1, False)
                if not full.startswith(base):
                    return None
                shift = length - len(base)
                if role == "assistant":
                    header = render(lo, index, True)
                    if not header.startswith(base):
                        return None
                    body = common_prefix(header, full, len(base)) + shift
                    spans += [Span(length, body, index), Span(body, len(full) + shift, index, trainable[index])]
                else:
                    spans.append(Span(length, len(full) + shift, index))
                pieces.append(full[len(base):])
                length += len(full) - len(base)
            text = "".join(pieces)
            if text != render(0, len(roles), False):
                return None
            if add_generation_prompt:
                prompt = render(0, len(roles), True)
                if not prompt.startswith(text):
                    return None
                spans.append(Span(len(text), len(prompt), -1))
                text = prompt
        except Exception:  # noqa: BLE001 - the template refused a window: the definition decides
            return None
        return text, spans

    #: turns per rendering window (even); a turn is rendered after at least one and at most this many
    _WINDOW: ClassVar[int] = 4

    @functools.cached_property
    def _windows_match(self) -> bool:
        """Whether windowed rendering gives the per-prefix spans on probe dialogues (with and
        without a system message, images in several turns, a generation prompt)."""
        for messages, head, roles, generation in self._probe_messages():
            trainable = self._trainable(roles, "all_assistant")
            windowed = self._spans_by_window(messages, head, roles, trainable, generation)
            try:
                defined = self._spans_by_prefix("probe", messages, head, roles, trainable, 0, generation)
            except TemplateNotPrefixStableError:
                return False
            except Exception:  # noqa: BLE001 - the template's own refusal of the probe
                defined = None
            if windowed != defined:
                return False
        return True

    @functools.cached_property
    def _prefix_stable(self) -> bool:
        """Whether rendering more turns keeps the text of earlier ones on the probe dialogues. A
        template that is not (Qwen3.5's writes ``<think>\n\n</think>\n\n`` only into answers after
        the last user turn) is rendered whole (:meth:`_spans_by_whole`)."""
        for messages, head, roles, generation in self._probe_messages():
            trainable = self._trainable(roles, "all_assistant")
            try:
                self._spans_by_prefix("probe", messages, head, roles, trainable, 0, generation)
            except TemplateNotPrefixStableError:
                return False
            except Exception:  # noqa: BLE001 - the template's own refusal of the probe: not this question
                continue
        return True

    def _probe_messages(self) -> list[tuple[list[dict], int, list[str], bool]]:
        """Probe dialogues as ``(messages, head, roles, add_generation_prompt)``: with and without a
        system message, images in several turns, a generation prompt."""
        image = Image("probe.png")
        user = [("Look at ", image, " and describe it."), ("Second question?",), (image, image, "Compare."),
                ("More text  with   spaces\n",), ("Last one: ", image)]
        answer = ["An answer.", " Another one.\n", "Third.", "Fourth answer here."]
        probes = []
        for system in (None, "Be brief."):
            messages = [self._message("system", (system,))] if system else []
            roles = []
            for k, segments in enumerate(user):
                messages.append(self._message("user", segments))
                roles.append("user")
                if k < len(answer):
                    messages.append(self._message("assistant", (answer[k],)))
                    roles.append("assistant")
            head = len(messages) - len(roles)
            probes += [(messages, head, roles, False), (messages, head, roles, True),
                       (messages[:-1], head, roles[:-1], False)]
        return probes

    #: marks the end of a message's content in :meth:`_spans_by_whole` (a private-use character)
    _END: ClassVar[str] = "\U000f0000"

    def _spans_by_whole(self, dialogue_id: str, messages: list[dict], head: int, roles: list[str],
                        trainable: list[bool], offset: int, add_generation_prompt: bool) -> tuple[str, list[Span]]:
        """Spans of a template that is not prefix-stable, from one render of the whole dialogue.

        Each message's content gets an end mark; the render with the marks removed must be the
        render without them. A turn ends where its content ends plus what the template renders
        after the content of a message that ends the dialogue (ChatML's ``<|im_end|>\n``); an
        answer's header is the part of its turn it shares with the generation prompt, the rest
        (content and end of turn, as the template shows the answer in this dialogue) is
        labelled: the assistant-mask semantics of ``apply_chat_template(return_assistant_tokens_mask=True)``
        without ``{% generation %}`` tags. The generation prompt is the template's own."""
        if add_generation_prompt and (not roles or roles[-1] != "user"):
            raise ValueError(f"dialogue {dialogue_id!r}: add_generation_prompt needs the dialogue to end with a user turn")
        for index, role in enumerate(roles):
            if role not in ("user", "assistant"):
                raise ValueError(f"dialogue {dialogue_id!r}, turn {index + offset}: role {role!r} is not allowed here")
        text = self._render(messages, add_generation_prompt)
        ends = self._content_ends(dialogue_id, messages, head, text, add_generation_prompt)
        spans: list[Span] = []
        start = 0
        for index, role in enumerate(roles):
            trail = self._trail(messages[:head + index + 1])
            end = ends[index] + len(trail)
            if text[ends[index]:end] != trail:
                self._refuse_whole(dialogue_id, index + offset, f"its end of turn {trail!r} is not rendered after it")
            if role == "assistant":
                before = self._render(messages[:head + index], add_generation_prompt=False)
                prompt = self._render(messages[:head + index], add_generation_prompt=True)
                if not prompt.startswith(before):
                    self._refuse_whole(dialogue_id, index + offset, "the generation prompt changes earlier text")
                body = common_prefix(prompt[len(before):], text[start:end]) + start
                spans += [Span(start, body, index), Span(body, end, index, trainable[index])]
            else:
                spans.append(Span(start, end, index))
            start = end
        if add_generation_prompt:
            spans.append(Span(start, len(text), -1))
        elif start != len(text):
            self._refuse_whole(dialogue_id, len(roles) - 1 + offset, f"text {text[start:]!r} follows the last turn")
        return text, spans

    def _content_ends(self, dialogue_id: str, messages: list[dict], head: int, text: str,
                      add_generation_prompt: bool) -> list[int]:
        """Where each message after ``head`` ends its content in ``text`` (the render of ``messages``)."""
        marked = self._render(self._marked(messages, head), add_generation_prompt)
        if marked.replace(self._END, "") != text or marked.count(self._END) != len(messages) - head:
            self._refuse_whole(dialogue_id, None, "marking the end of each message's content changes the render")
        ends, removed = [], 0
        for at, char in enumerate(marked):
            if char == self._END:
                ends.append(at - removed)
                removed += 1
        return ends

    def _marked(self, messages: list[dict], head: int) -> list[dict]:
        out = list(messages[:head])
        for message in messages[head:]:
            content = [dict(item) for item in message["content"]]
            if content[-1].get("type") == "text":
                content[-1]["text"] = content[-1]["text"] + self._END
            else:
                content.append({"type": "text", "text": self._END})
            out.append({**message, "content": content})
        return out

    def _trail(self, messages: list[dict]) -> str:
        """What the template renders after the content of the last of ``messages``."""
        marked = self._render(self._marked(messages, len(messages) - 1), add_generation_prompt=False)
        return marked[marked.rindex(self._END) + 1:]

    def _refuse_whole(self, dialogue_id: str, turn: int | None, what: str) -> None:
        where = f"dialogue {dialogue_id!r}" + (f", turn {turn}" if turn is not None else "")
        raise TemplateNotPrefixStableError(
            f"{where}: the chat template of {self.config.path!r} is not prefix-stable, and rendering the whole "
            f"dialogue cannot place its turns: {what}. Use a template that renders earlier turns identically, or a "
            "family adapter."
        )

"""Stage 4: the stop token every answer is trained to end with (``model.auto.answer_stop``)."""

from __future__ import annotations

import functools

from mmtune.models.base import EncodedTurn, TokenChunk

__all__ = ["AnswerStopStage"]


class AnswerStopStage:
    """How answers end (mixed into the adapter: needs ``_render``, ``_message``, ``tokenizer``)."""

    @functools.cached_property
    def _template_answer_end(self) -> tuple[str, int | None]:
        """How the chat template ends an answer: ``("own", None)`` with a generation stop token in
        the answer's own text; ``("next", id)`` with one as the first token it renders after the
        answer (GLM-4.1V: the next turn's ``<|user|>``, one of its generation config's
        ``eos_token_id``); ``("none", None)`` with neither (llava-hf's LLaVA templates), or for a
        template whose turns are not prefix-stable on the probe (refused per dialogue later)."""
        user, answer = self._message("user", ("a",)), self._message("assistant", ("b",))
        before = self._render([user], add_generation_prompt=True)
        after = self._render([user, answer], add_generation_prompt=False)
        following = self._render([user, answer, user], add_generation_prompt=False)
        if not (after.startswith(before) and following.startswith(after)):
            return "own", None
        stops = set(self.stop_token_ids)
        own = self.tokenizer(after[len(before):], add_special_tokens=False)["input_ids"]
        if stops & set(own):
            return "own", None
        next_ids = self.tokenizer(following[len(after):], add_special_tokens=False)["input_ids"]
        if next_ids and next_ids[0] in stops:
            return "next", int(next_ids[0])
        return "none", None

    @functools.cached_property
    def _answer_ends(self) -> tuple[int | None, bool]:
        """``(stop, appended)``: the stop token given to every answer whose text holds none, and
        whether it is appended (``model.auto.answer_stop=eos`` on a template with no stop token:
        the tokenizer's EOS) rather than moved from the next turn; ``(None, False)``: nothing to add."""
        end, stop = self._template_answer_end
        if end == "next":
            return stop, False
        if end == "none" and self.config.settings.answer_stop == "eos" and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id), True
        return None, False

    @property
    def _answer_stop(self) -> int | None:
        return self._answer_ends[0]

    def _label_answer_stops(self, turns: list[EncodedTurn]) -> None:
        """Give every assistant turn the stop token the model must learn to end it with
        (:attr:`_answer_ends`), labelled: the next turn's first token moves into the answer, and
        the last answer of the dialogue gets one appended (what the template renders next). An
        appended EOS (``model.auto.answer_stop=eos``) goes after every answer, trained or not (so
        the text is the same whichever turns ``train_on`` picks), labelled where the answer is."""
        stop, appended = self._answer_ends
        for index, turn in enumerate(turns):
            if turn.role != "assistant":
                continue
            trainable = any(isinstance(c, TokenChunk) and c.trainable for c in turn.chunks)
            if appended:
                turn.chunks.append(TokenChunk((stop,), trainable))
                continue
            if not trainable:
                continue
            following = turns[index + 1] if index + 1 < len(turns) else None
            if following is None:
                turn.chunks.append(TokenChunk((stop,), True))
                continue
            first = following.chunks[0] if following.chunks else None
            if isinstance(first, TokenChunk) and first.ids and first.ids[0] == stop:
                rest = first.ids[1:]
                following.chunks[0:1] = [TokenChunk(rest, first.trainable)] if rest else []
                turn.chunks.append(TokenChunk((stop,), True))

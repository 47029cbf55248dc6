"""The ``auto`` family's start-up check: ids too (the shared check is
:mod:`mmtune.models.authority`, image inputs).

Its text is the processor's, so the probe dialogue goes through
``processor(text=[processor.apply_chat_template(messages)], images=images)`` once and both the
ids and every image input are compared with mmtune's stages. The processor's own text changes
(:attr:`~mmtune.models.auto.profile.ProfileStage._text_change`) are already mmtune's; any other
difference refuses the run, naming the first differing token and where to look.
"""

from __future__ import annotations

from typing import Any

from mmtune.core.dialogue import Dialogue
from mmtune.models.authority import ProcessorAuthority, probe_paths
from mmtune.models.auto.errors import UnsupportedProcessorError

__all__ = ["ProcessorCallAuthority"]


class ProcessorCallAuthority(ProcessorAuthority):
    """:class:`ProcessorAuthority` with the ids of the processor's whole call compared too."""

    mismatch_error = UnsupportedProcessorError

    def _check_probe(self, dialogue: Dialogue) -> None:
        theirs = self._processor_call(dialogue)
        self._compare_ids(self._probe_ids(dialogue), theirs["input_ids"][0].tolist())
        self._compare_images(self.image_inputs(probe_paths(dialogue)), theirs)

    def _probe_ids(self, dialogue: Dialogue) -> list[int]:
        """mmtune's ids of the whole dialogue, as rendered (before answer stops are relabelled)."""
        text, spans, offset = self._spans(dialogue, None, "all_assistant", False)
        tokens = self._tokens(dialogue, text, spans, offset)
        ids: list[int] = []
        for position, token in enumerate(tokens.ids):
            ids.extend(tokens.cores.get(position, (token,)))
        return ids

    def _processor_call(self, dialogue: Dialogue) -> dict[str, Any]:
        from transformers.image_utils import load_image

        messages = [self._message(t.role, t.segments) for t in dialogue.turns]
        text = self.processor.apply_chat_template(messages, tokenize=False)
        images = [load_image(path) for path in probe_paths(dialogue)]
        bos = self.tokenizer.bos_token
        # no second BOS where the template renders one, as the processor's own apply_chat_template
        kwargs = {"add_special_tokens": False} if bos is not None and text.startswith(bos) else {}
        return self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)

    def _compare_ids(self, mine: list[int], theirs: list[int]) -> None:
        if mine == theirs:
            return
        k = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))

        def token(ids: list[int]) -> str:
            return repr(self.tokenizer.convert_ids_to_tokens(ids[k])) if k < len(ids) else "the end of the text"

        context = self.tokenizer.decode(theirs[max(0, k - 8):k + 8])
        raise UnsupportedProcessorError(
            f"model.path={self.config.path!r}: on a probe dialogue mmtune's encoding differs from the processor's "
            f"(processor(text=[apply_chat_template(messages)], images=...)) at token {k}: the processor gives "
            f"{token(theirs)}, mmtune {token(mine)} (near {context!r}). The processor's call changes the text in a "
            "way mmtune does not reproduce: look at the settings of processor_config.json / tokenizer_config.json "
            "that change text (a default system prompt, added BOS/EOS) and the chat_template, or use a family adapter"
        )

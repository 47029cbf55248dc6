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
        import torch

        theirs = self._processor_call(dialogue)
        self._compare_ids(self._probe_ids(dialogue), theirs["input_ids"][0].tolist())
        mine = self.image_inputs(probe_paths(dialogue))
        self._compare_images(mine, theirs)
        for name, values in self.token_inputs(theirs["input_ids"]).items():
            if name in theirs and not torch.equal(values, theirs[name].long()):
                k = int((values != theirs[name]).flatten().nonzero()[0])
                raise UnsupportedProcessorError(
                    f"model.path={self.config.path!r}: on a probe dialogue mmtune's {name!r} differs from the "
                    f"processor's at token {k} ({int(values.flatten()[k])} vs {int(theirs[name].flatten()[k])})")
        if self._rope is not None:
            self._compare_positions(mine, theirs)

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
        # a processor that keeps no template of its own (Chameleon's: the tokenizer holds it) is handed
        # the one mmtune loaded, as its own apply_chat_template would be
        own = {} if getattr(self.processor, "chat_template", None) else {"chat_template": self.chat_template}
        text = self.processor.apply_chat_template(messages, tokenize=False, **own)
        images = [load_image(path) for path in probe_paths(dialogue)]
        kwargs = {} if self._add_special_tokens(text) else {"add_special_tokens": False}
        return self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)

    def _compare_positions(self, mine: dict[str, Any], theirs: dict[str, Any]) -> None:
        """mmtune's positions of the probe (its own image inputs) against the model class's
        ``get_rope_index`` on the processor's whole call, as the model's forward computes them."""
        import torch

        rope, ids = self._rope, theirs["input_ids"]
        marks = theirs.get("mm_token_type_ids")
        if marks is None:
            marks = rope._marks(ids[0]).int()[None]
        given = {name: theirs[name] for name in rope.image_params if name in theirs}
        try:
            want = rope.model.get_rope_index(ids, mm_token_type_ids=marks, **given)[0][:, 0]
            got = self.position_ids(ids[0], mine)
        except Exception as err:  # noqa: BLE001 - named as the start-up refusal it is
            raise UnsupportedProcessorError(
                f"model.path={self.config.path!r}: the position ids of a probe dialogue cannot be computed with "
                f"{rope.model_class.__name__}.get_rope_index from the image inputs {sorted(mine)} "
                f"(it reads {list(rope.image_params)}): {type(err).__name__}: {err}") from err
        if got.shape != want.shape or not torch.equal(got, want):
            k = int((got != want).any(0).nonzero()[0]) if got.shape == want.shape else 0
            raise UnsupportedProcessorError(
                f"model.path={self.config.path!r}: on a probe dialogue mmtune's position ids {tuple(got.shape)} differ "
                f"from {rope.model_class.__name__}.get_rope_index on the processor's call {tuple(want.shape)}, first "
                f"at token {k}")

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

"""Stage 6: the processor is the authority, checked at start-up.

Once per checkpoint (per process, keyed by the adapter's fingerprint) a probe dialogue (a
system message, several turns, several images in one turn and in later turns) is encoded both
ways: ``processor(text=[processor.apply_chat_template(messages)], images=images)`` and mmtune's
stages. The processor's own text changes (:attr:`ProfileStage._text_change`) are already
mmtune's; any other difference in the ids or in an image input refuses the run, naming the
first differing token and where to look. Never silent.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.models.auto.errors import UnsupportedProcessorError
from mmtune.models.auto.profile import noise_image

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["AuthorityStage"]

#: fingerprints of the checkpoints this process has checked
_CHECKED: set[str] = set()

#: (width, height) of the probe's images: wide, tall, square
_PROBE_SIZES = ((50, 30), (24, 70), (40, 40))


def _probe_dialogue(folder: str) -> Dialogue:
    paths = []
    for k, (width, height) in enumerate(_PROBE_SIZES):
        path = os.path.join(folder, f"probe{k}.png")
        noise_image(width, height, 10 + k).save(path)
        paths.append(Image(path))
    turns = (
        Turn("system", ("Answer briefly.",)),
        Turn("user", (paths[0], "What is shown?")),
        Turn("assistant", ("A red square.",)),
        Turn("user", ("Compare ", paths[1], " and ", paths[2], ".")),
        Turn("assistant", ("The first is taller.",)),
        Turn("user", ("Thanks.",)),
        Turn("assistant", ("You are welcome.",)),
    )
    return Dialogue("processor-probe", "probe", turns)


class AuthorityStage:
    """The start-up check against the processor (mixed into the adapter)."""

    def _check_against_processor(self) -> None:
        """Encode the probe dialogue both ways; refuse on any difference.

        Raises:
            UnsupportedProcessorError: the first differing token, or the image input that differs.
        """
        key = self.fingerprint()
        if key in _CHECKED:
            return
        with tempfile.TemporaryDirectory(prefix="mmtune-probe-") as folder:
            dialogue = _probe_dialogue(folder)
            mine = self._probe_ids(dialogue)
            theirs = self._processor_call(dialogue)
            self._compare_ids(mine, theirs["input_ids"][0].tolist())
            paths = [image.path for turn in dialogue.turns for image in turn.images]
            self._compare_images(self.image_inputs(paths), theirs)
        _CHECKED.add(key)

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
        images = [load_image(image.path) for turn in dialogue.turns for image in turn.images]
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

    def _compare_images(self, mine: dict[str, "torch.Tensor"], theirs: dict[str, Any]) -> None:
        import torch

        for name in self.image_input_names:
            want = theirs.get(name)
            got = mine.get(name)
            if not (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.dtype == want.dtype
                    and got.shape == want.shape and torch.equal(got, want)):
                described = (f"{tuple(want.shape)} {want.dtype}" if isinstance(want, torch.Tensor) else repr(want))
                mine_described = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)
                raise UnsupportedProcessorError(
                    f"model.path={self.config.path!r}: on a probe dialogue the image input {name!r} mmtune builds "
                    f"image by image ({mine_described}) differs from the processor's call on all images "
                    f"({described}); the processor's image settings (preprocessor_config.json) make outputs that "
                    "depend on the other images of the call"
                )

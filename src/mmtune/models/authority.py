"""The encoder's last stage: the processor is the authority, checked at start-up.

Once per checkpoint (per process, keyed by the adapter's fingerprint) a probe dialogue (a system
message, several turns, several images in one turn and in later turns: wide, tall and square) is
encoded by the adapter's stages and by the checkpoint's processor, and any difference refuses the
run, naming the first differing token or the image input that differs. Never silent.

What is compared is what the processor decides for the family:

- here (:class:`ProcessorAuthority`), the image inputs: the adapter's, built image by image (what
  the pixel cache stores), against the image processor's call on all the probe's images. A family
  whose text stage follows its official training code (LLaVA-1.5's ``preprocess_v1``, the Qwen-VL
  fine-tuning code) names that code in :attr:`ProcessorAuthority.text_authority`, logged at
  start-up; its golden tests hold the text to it;
- the ``auto`` family (:mod:`mmtune.models.auto.authority`) also compares the ids with
  ``processor(text=[apply_chat_template(messages)], images=images)``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import TYPE_CHECKING, Any, ClassVar

from mmtune.core.dialogue import Dialogue, Image, Turn
from mmtune.models.images import noise_image

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ProcessorAuthority", "ProcessorMismatchError", "probe_dialogue"]

log = logging.getLogger(__name__)

#: fingerprints of the checkpoints this process has checked
_CHECKED: set[str] = set()

#: (width, height) of the probe's images: wide, tall, square
_PROBE_SIZES = ((50, 30), (24, 70), (40, 40))


class ProcessorMismatchError(ValueError):
    """An adapter's stages and the checkpoint's processor disagree on the start-up probe."""


def probe_dialogue(folder: str) -> Dialogue:
    """The start-up probe: a system message, three exchanges, three images (two in one turn)
    written as PNG files into ``folder``."""
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


def probe_paths(dialogue: Dialogue) -> list[str]:
    return [image.path for turn in dialogue.turns for image in turn.images]


class ProcessorAuthority:
    """The start-up check against the processor (mixed into the encoder)."""

    #: what decides the text where it is not the processor's chat template (a family's official
    #: training code), stated at start-up; "" where the processor decides it
    text_authority: ClassVar[str] = ""
    #: largest difference of a floating image input from the processor's that is not one (LLaVA
    #: normalises cached uint8 pixels in one multiply-add per value: within 1e-6 of the processor's
    #: two steps); 0: equal to the bit
    pixel_tolerance: ClassVar[float] = 0.0
    #: the error a difference raises (the ``auto`` family's is its ``UnsupportedProcessorError``)
    mismatch_error: ClassVar[type[ProcessorMismatchError]] = ProcessorMismatchError

    def _check_authority(self) -> None:
        """Encode the probe both ways once per checkpoint; refuse on any difference.

        Raises:
            ProcessorMismatchError: the first differing token, or the image input that differs.
        """
        key = self.fingerprint()
        if key in _CHECKED:
            return
        if self.text_authority:
            log.info("model.family=%s: text and labels follow %s; image inputs are checked against the processor",
                     self.family, self.text_authority)
        with tempfile.TemporaryDirectory(prefix="mmtune-probe-") as folder:
            self._check_probe(probe_dialogue(folder))
        _CHECKED.add(key)

    def _check_probe(self, dialogue: Dialogue) -> None:
        """The image inputs of the probe's images against the image processor's call on them all."""
        from transformers.image_utils import load_image

        paths = probe_paths(dialogue)
        theirs = self.image_processor(images=[load_image(p) for p in paths], return_tensors="pt")
        self._compare_images(self.image_inputs(paths), theirs)

    def _compare_images(self, mine: dict[str, "torch.Tensor"], theirs: dict[str, Any]) -> None:
        import torch

        for name in self.image_input_names:
            want = theirs.get(name)
            got = mine.get(name)
            same = (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.dtype == want.dtype
                    and got.shape == want.shape)
            if same and self.pixel_tolerance and got.is_floating_point():
                same = torch.allclose(got, want, rtol=0.0, atol=self.pixel_tolerance)
            elif same:
                same = torch.equal(got, want)
            if not same:
                described = (f"{tuple(want.shape)} {want.dtype}" if isinstance(want, torch.Tensor) else repr(want))
                mine_described = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else repr(got)
                if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape:
                    mine_described += f", largest difference {float((got.double() - want.double()).abs().max()):.3g}"
                raise self.mismatch_error(
                    f"model.family={self.family} model.path={self.config.path!r}: on a probe dialogue the image input "
                    f"{name!r} mmtune builds image by image ({mine_described}) differs from the processor's call on "
                    f"all images ({described}); the processor's image settings (preprocessor_config.json) make "
                    "outputs that depend on the other images of the call, or that mmtune's image stage does not "
                    "reproduce"
                )

"""The models layer's one encoder: a dialogue and its images become ids, labels, image inputs and
position ids in stages, each with one job, run in this order at start-up.

1. **profile** (``_load_profile``): tokenizer, processor, chat template, model config, the image
   and stop token ids;
2. **images** (``_setup_images`` and the image methods): each image's model inputs (what the pixel
   cache stores), joined per batch as the processor joins them;
3. **text** (``_setup_text`` and ``encode_dialogue``; ``encode_many`` / ``measure_many`` where the
   family batches): a dialogue's ids and labels, image tokens in place;
4. **positions** (:mod:`.positions`, the same for every family): one running position, or the model
   class's own ``get_rope_index`` (M-RoPE), and whether packed rows can carry the running position;
5. **authority** (:mod:`.authority`, the check in ``_check_probe``): the stages against the
   checkpoint's processor on a probe dialogue, once per checkpoint;

and the model hooks (:mod:`.hooks`: load, module groups, loss modules, dummy vision pass), the same
for every family.

Every transformers family is this class with stages chosen:

- ``auto`` (:mod:`.auto`): the processor decides everything: its chat template rendered into
  spans, each image's text and inputs from the processor itself, and ids as well as images checked
  against ``processor(text=[apply_chat_template(...)], images=...)``;
- ``llava`` (:mod:`.llava`): replaces the profile (a random-weight tiny model, or a checkpoint's
  tokenizer and config), the text stage (Vicuna v1 turns tokenized in SentencePiece chunks, as
  LLaVA-1.5's ``preprocess_v1``) and the image stage (pad to a square with the mean colour, as its
  training did, kept as squared uint8 images); the image check compares with LLaVA's image
  processor set to pad;
- ``qwen2_vl`` (:mod:`.qwen2_vl`): replaces the profile (tokenizer, PIL image processor and
  template file: no processor class, so no torchvision), the text stage (the Qwen-VL fine-tuning
  code's conversation text and labels) and the image stage, which keeps the image processor's
  numbers through a uint8 pixel cache (resize once, patchify per batch: about 3x the HF path's
  collation rate where the ``auto`` family's float-patch cache gives 0.9x, docs/collator.md).

InternLM-XComposer2 is not in transformers: it stays a native adapter on the same model hooks.
"""

from __future__ import annotations

from typing import Any

from mmtune.models.authority import ProcessorAuthority
from mmtune.models.base import ModelAdapter
from mmtune.models.config import ModelConfig
from mmtune.models.hooks import TransformersModelHooks
from mmtune.models.positions import RopePositions, packed_layout_problem, rope_index_for

__all__ = ["Encoder"]


class Encoder(RopePositions, ProcessorAuthority, TransformersModelHooks, ModelAdapter):
    """The stages in order (see the module doc); a family overrides the steps it replaces.

    After ``__init__`` an adapter has ``config``, ``tokenizer``, ``model_config``,
    ``image_token_id``, ``stop_token_ids`` (profile), its image inputs (images), its text stage
    ready (text), ``_rope`` / ``position_id_rows`` / ``packing_problem`` (positions), and has been
    checked against its processor (authority).
    """

    model_config: Any

    def __init__(self, config: ModelConfig):
        config.validate()
        self.config = config
        self._load_profile()
        self._setup_images()
        self._setup_text()
        self._setup_positions()
        self._check_authority()

    def _load_profile(self) -> None:
        """Stage 1: set ``tokenizer``, ``model_config``, ``image_token_id`` and ``stop_token_ids``
        (and what the family's later stages read: its processor, its chat template)."""
        raise NotImplementedError(f"{type(self).__name__} does not load its profile")

    def _setup_images(self) -> None:
        """Stage 2: what the image methods need (probes of the processor, an image transform)."""

    def _setup_text(self) -> None:
        """Stage 3: what the text stage needs (a renderer, a tokenizer of its own, start-up checks)."""

    def _image_marks(self) -> list[int] | None:
        """The token ids the processor marks 1 in ``mm_token_type_ids`` (where the profile read
        them: the ``auto`` family); ``None``: the image token alone."""
        return None

    def _setup_positions(self) -> None:
        """Stage 4, the same for every family: the model's own rope index where its class has one
        (on :meth:`_image_marks`), and why packed rows cannot carry the running position before the
        rope rows, if the model refuses it."""
        self._rope = rope_index_for(self.model_config, self.image_token_id, self._image_marks())
        self.position_id_rows = self._rope.rows if self._rope is not None else 1
        self.packing_problem = (packed_layout_problem(self.text_config(self.model_config), self.position_id_rows)
                                if self.position_id_rows > 1 else "")

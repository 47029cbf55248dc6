"""The ``qwen2_vl`` adapter: Qwen2-VL, Qwen2.5-VL and Qwen3-VL on transformers' own classes.

The class is chosen by the checkpoint config's ``model_type`` (``qwen2_vl``, ``qwen2_5_vl``,
``qwen3_vl``), never by the checkpoint's name. Everything that decides tokens comes from the
checkpoint: its chat template (:mod:`~mmtune.models.qwen2_vl.template`: the system prompt
default is read off it and the layout is checked on probe conversations), its tokenizer and
its image processor (:mod:`~mmtune.models.qwen2_vl.images`, PIL backend: no torchvision).

An image is ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>``: the
:class:`~mmtune.core.encoded.ImageChunk` covers the N pad tokens (N from the file header and
the processor's ``min_pixels`` / ``max_pixels``), the start / end tokens are template tokens.

Its model-agnostic batch (the contract of :mod:`mmtune.models.base`):

- :attr:`~Qwen2VLAdapter.image_input_names` ``("pixel_values", "image_grid_thw")``:
  :meth:`Qwen2VLAdapter.image_inputs` ``(paths) -> {"pixel_values": [sum patches, D],
  "image_grid_thw": [N, 3]}``; both concatenate along dim 0 in image order across a batch;
  the pixel cache stores :meth:`~Qwen2VLAdapter.load_uint8` per image and
  :meth:`~Qwen2VLAdapter.image_batch` finishes them;
- :attr:`~Qwen2VLAdapter.position_id_rows` = 3: :meth:`Qwen2VLAdapter.position_ids`
  ``(input_ids [L], image_inputs) -> [3, L]`` (M-RoPE, transformers' rope index of one sample),
  laid out ``[4, B, L]`` for the forward (the base class's ``model_position_ids``).

With ``ModelConfig.path = None`` it builds a random-weight tiny model of
``architecture.model_type`` (default ``qwen2_vl``) from :mod:`mmtune.testing.qwen2_vl`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from mmtune.core.dialogue import Image
from mmtune.models._utils import PieceText, Plan, state_fingerprint
from mmtune.models.base import ModuleGroups
from mmtune.models.config import FamilySettings, ModelConfig, positive_or_null
from mmtune.models.encoder import Encoder
from mmtune.models.qwen2_vl.images import QwenVLImages
from mmtune.models.qwen2_vl.published import KNOWN_ARCHITECTURES
from mmtune.models.qwen2_vl.template import CHAT_TEMPLATES, IMAGE_PAD, renderer_for_template
from mmtune.models.qwen2_vl.classes import MODEL_TYPES, model_classes, routed_model_types
from mmtune.models.registry import register_adapter

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from torch import nn

    from mmtune.core.dialogue import Dialogue

__all__ = ["Qwen2VLAdapter", "model_classes", "load_chat_template"]

def load_chat_template(path: str, tokenizer: Any) -> str | None:
    """The checkpoint's chat template: the processor's (``chat_template.jinja`` /
    ``chat_template.json``, what ``AutoProcessor`` uses), else the tokenizer's; ``None``
    when it has neither."""
    from transformers.utils import cached_file

    for name in ("chat_template.jinja", "chat_template.json"):
        file = cached_file(
            path, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False
        )
        if file:
            with open(file, encoding="utf-8") as handle:
                text = handle.read()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return getattr(tokenizer, "chat_template", None) or None


@dataclass
class Qwen2VLSettings(FamilySettings):
    """``model.qwen2_vl``: the pixel bounds of the image processor's ``smart_resize``."""

    min_pixels: Optional[int] = None
    """Smallest image area (pixels) after resizing; smaller images are scaled up to it.
    ``None`` = the checkpoint processor's value. Fewer pixels = fewer image tokens."""
    max_pixels: Optional[int] = None
    """Largest image area (pixels) after resizing, i.e. at most
    ``max_pixels / (patch_size * merge_size)^2`` tokens per image (28 px units for Qwen2-VL /
    Qwen2.5-VL, 32 px for Qwen3-VL). ``None`` = the checkpoint processor's value."""

    def problems(self, prefix: str) -> list[str]:
        problems = []
        for key in ("min_pixels", "max_pixels"):
            problems += positive_or_null(getattr(self, key), f"{prefix}.{key}", "the checkpoint processor's value")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            problems.append(f"{prefix}.min_pixels={self.min_pixels} is above {prefix}.max_pixels={self.max_pixels}")
        return problems


@register_adapter
class Qwen2VLAdapter(PieceText, Encoder):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the one encoder (:mod:`mmtune.models.encoder`) with the
    text stage replaced by the official fine-tuning code's (the checkpoint's ChatML template rendered
    turn by turn, its labels), the profile read without the processor class (tokenizer, PIL image
    processor, template file) and the image stage keeping the image processor's numbers through a
    uint8 pixel cache (checked against the image processor at start-up). Positions (M-RoPE from the
    model's own rope index) and the model hooks are the encoder's.

    ``system_prompt`` (when the dialogue has no system turn) replaces the template's default
    system prompt; ``""`` renders an empty system message.
    """

    family = "qwen2_vl"
    settings_class = Qwen2VLSettings
    # The language model's linear layers (the vision tower's are named qkv / proj / fc* /
    # linear_fc*, but Qwen2.5-VL's vision MLP also has gate/up/down_proj: see the exclude).
    default_lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    #: peft ``exclude_modules`` regex keeping LoRA off the vision tower and merger (and what a
    #: 4-bit base model keeps in full precision)
    lora_exclude_modules = r".*\bvisual\b.*"
    #: the projector is the vision tower's ``merger`` (the module the official ``tune_mm_mlp``
    #: switch trains); the tower's other children (patch embedding, blocks, Qwen3-VL's position
    #: embedding and DeepStack mergers) are vision
    vision_projector_children = ("merger",)
    text_authority = ("the Qwen-VL fine-tuning code (qwen-vl-finetune's conversation text and labels; its layout "
                      "checked against the checkpoint's chat template on probe conversations)")
    #: the model inputs images become (both concatenate along dim 0 in image order)
    image_input_names = ("pixel_values", "image_grid_thw")
    #: the released checkpoints the shipped configs name, for ``mmtune plan`` offline
    known_architectures = KNOWN_ARCHITECTURES

    @classmethod
    def meta_model(cls, config: ModelConfig, checkpoint_config: dict[str, Any] | None) -> tuple["nn.Module", ModuleGroups]:
        """The checkpoint's class (by ``model_type``) on the meta device, grouped as
        :meth:`module_groups` groups it (the merger is the projector, inside ``visual``)."""
        if checkpoint_config is None:
            return super().meta_model(config, None)
        import torch
        from transformers import AutoConfig

        model_type = checkpoint_config.get("model_type")
        generation_class = model_classes(str(model_type))
        model_config = AutoConfig.for_model(**checkpoint_config)
        with torch.device("meta"):
            model = generation_class._from_config(model_config)
        return model, cls.group_modules(model)

    @classmethod
    def routed_family(cls, config: ModelConfig) -> str | None:
        """``auto`` for a later class of the line (:func:`routed_model_types`: Qwen3.5 ...), read from its config."""
        if config.path is None:
            return None
        from transformers import PretrainedConfig

        try:
            values, _ = PretrainedConfig.get_config_dict(config.path)
        except (OSError, ValueError):
            return None  # the adapter names the problem when it loads the config
        return "auto" if values.get("model_type") in routed_model_types() else None

    @classmethod
    def planned_image_tokens(cls, config: ModelConfig, model_config: Any) -> int | None:
        """The most tokens an image can become under ``model.qwen2_vl.max_pixels`` (large
        photos reach it): ``max_pixels // (patch x merge)^2``; ``None`` without the bound (it
        depends on each image)."""
        max_pixels = config.settings.max_pixels
        if max_pixels is None:
            return None
        vc = model_config.vision_config
        return int(max_pixels) // (int(vc.patch_size) * int(vc.spatial_merge_size)) ** 2

    def _load_profile(self) -> None:
        """The tokenizer, model config, PIL image processor (``model.qwen2_vl`` pixel bounds applied)
        and chat template: a random-weight tiny model's of ``architecture.model_type``, or the
        checkpoint's; the image and stop tokens checked against them."""
        config = self.config
        self._where = where = config.path or "the random-weight model (model.path=null)"
        if config.path is None:
            model_type = str(config.architecture.get("model_type", "qwen2_vl"))
            if model_type not in MODEL_TYPES:
                raise ValueError(
                    f"model.architecture.model_type={model_type!r}: use one of {list(MODEL_TYPES)}"
                )
            from mmtune.testing.qwen2_vl import tiny_image_processor, tiny_model_config, tiny_tokenizer

            self.tokenizer = tiny_tokenizer()
            self.model_config = tiny_model_config(model_type, self.tokenizer, config.architecture)
            image_processor = tiny_image_processor(
                self.model_config, min_pixels=config.settings.min_pixels, max_pixels=config.settings.max_pixels
            )
            template = CHAT_TEMPLATES[model_type]
        else:
            from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

            self.model_config = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
            model_type = getattr(self.model_config, "model_type", None)
            if model_type not in MODEL_TYPES:
                raise ValueError(
                    f"{config.path} is a {model_type!r} checkpoint ({type(self.model_config).__name__}); the qwen2_vl "
                    f"family covers model types {list(MODEL_TYPES)}. Use the family of that model instead"
                )
            self.tokenizer = AutoTokenizer.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
            image_processor = AutoImageProcessor.from_pretrained(config.path, backend="pil")
            _override_pixels(image_processor, config)
            template = load_chat_template(config.path, self.tokenizer)
            if not template:
                raise ValueError(
                    f"{config.path} has no chat template (no chat_template.jinja / chat_template.json and none in "
                    "tokenizer_config.json). The qwen2_vl adapter encodes with the checkpoint's own template: copy "
                    "chat_template.json from the base model this checkpoint came from (e.g. "
                    "Qwen/Qwen2.5-VL-7B-Instruct), or write mmtune.models.qwen2_vl.CHAT_TEMPLATES[model_type] there"
                )
        self.model_type = model_type
        self.chat_template = template
        self.image_processor = image_processor
        self.image_token_id = int(self.model_config.image_token_id)
        problems = []
        for key, token in (("image_token_id", IMAGE_PAD), ("vision_start_token_id", "<|vision_start|>"),
                           ("vision_end_token_id", "<|vision_end|>")):  # fmt: skip
            token_id = getattr(self.model_config, key)
            if self.tokenizer.convert_ids_to_tokens(int(token_id)) != token:
                problems.append(f"config {key}={token_id} is {self.tokenizer.convert_ids_to_tokens(int(token_id))!r}, "
                                f"expected {token!r}")  # fmt: skip
        if problems:
            raise ValueError(
                f"the tokenizer and model config of {where} do not belong together: " + "; ".join(problems)
            )
        stops = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.stop_token_ids = [int(i) for i in stops if i is not None]

    def _setup_images(self) -> None:
        """Image grids from file headers and pixels from the image processor's settings."""
        self.images = QwenVLImages(self.image_processor, self.model_config.vision_config, self._where,
                                   self.config.image_limits)

    def _setup_text(self) -> None:
        """The renderer of the checkpoint's template (its layout checked on probe conversations), and
        a tokenizer of our own that keeps control-token strings inside dialogue text as plain text (a
        literal "<|im_end|>" in an answer cannot end the turn or fake an image)."""
        from tokenizers import Tokenizer

        self.renderer = renderer_for_template(self.chat_template, self.tokenizer, self._where)
        self._encoder = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
        self._encoder.encode_special_tokens = True

    # -- identity --------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """A short hash of everything that changes encoded ids or lengths (for length caches)."""
        state = {
            "family": self.family,
            "model_type": self.model_type,
            "path": self.config.path,
            "architecture": self.config.architecture,
            "vocab": len(self.tokenizer),
            "tokenizer": getattr(self.tokenizer, "name_or_path", ""),
            "template": hashlib.sha1(self.chat_template.encode()).hexdigest(),
            "default_system": self.renderer.default_system,
            "answer_plain": self.renderer.answer_plain,
            "images": self.images.settings(),
        }
        return state_fingerprint(state)

    def processor_settings(self) -> dict[str, Any]:
        """What determines the pixels an image becomes (part of the pixel cache key)."""
        return self.images.settings()

    def save_pretrained(self, directory: str) -> None:
        """Write the tokenizer, the image processor (with the ``min_pixels`` / ``max_pixels``
        trained with) and the chat template, so ``ModelConfig(family="qwen2_vl", path=directory)``
        loads the checkpoint back with the same tokens and pixels."""
        os.makedirs(directory, exist_ok=True)
        self.tokenizer.save_pretrained(directory)
        self.image_processor.save_pretrained(directory)
        with open(os.path.join(directory, "chat_template.json"), "w", encoding="utf-8") as handle:
            json.dump({"chat_template": self.chat_template}, handle, indent=2, ensure_ascii=False)

    # -- rendering ---------------------------------------------------------------------------------
    def _check_images(self, dialogue: "Dialogue") -> None:
        """Count every image once with its dialogue and turn, so a refused or unreadable image
        is named there (the counts are memoized for :meth:`image_token_count`)."""
        for t, turn in enumerate(dialogue.turns):
            for image in turn.images:
                self.images.grid(image.path, dialogue_id=dialogue.id, turn=t)

    def _pieces(
        self, dialogue: "Dialogue", system_prompt: str | None, train_on: str, add_generation_prompt: bool
    ) -> Plan:
        self._check_images(dialogue)
        return self.renderer.plan(dialogue, system_prompt, train_on, add_generation_prompt)

    def _tokenize_many(self, texts: list[str]) -> list[list[int]]:
        # headers and "\n" repeat in every turn: tokenize each distinct text once
        unique = list(dict.fromkeys(texts))
        ids = dict(zip(unique, (e.ids for e in self._encoder.encode_batch(unique, add_special_tokens=False))))
        return [ids[text] for text in texts]

    # -- images ------------------------------------------------------------------------------------
    def image_token_count(self, image: Image) -> int:
        """``grid_t * grid_h * grid_w / merge_size**2`` from the file header (no pixel decode)."""
        return self.images.tokens(self.images.grid(image.path))

    def image_grid(self, image: Image) -> tuple[int, int, int]:
        """The image's ``image_grid_thw`` row, from the file header."""
        return self.images.grid(image.path)

    def image_inputs(self, paths: list[str]) -> dict[str, "torch.Tensor"]:
        """``{"pixel_values": [sum of patches, 3 x temporal_patch x patch^2] float32,
        "image_grid_thw": [N, 3] long}`` of these images, equal to the image processor's output;
        concatenate each along dim 0 in image order to batch several samples."""
        return self.images.inputs(paths)

    def load_uint8(self, path: str) -> "np.ndarray":
        """The decoded, resized uint8 image [3, H', W'] (what a pixel cache stores)."""
        return self.images.load_uint8(path)

    def image_inputs_uint8(self, images: Sequence[Any]) -> dict[str, "torch.Tensor"]:
        """:meth:`image_inputs` of images from :meth:`load_uint8` (rescale, normalise, patchify)."""
        return self.images.inputs_uint8(images)

    # the model-agnostic batch (models/base.py): the pixel cache holds each resized uint8 image
    def load_image(self, path: str) -> "np.ndarray":
        """What the pixel cache stores: :meth:`load_uint8` (shapes differ between images)."""
        return self.load_uint8(path)

    def image_batch(self, images: Sequence[Any]) -> dict[str, "torch.Tensor"]:
        """:meth:`image_inputs_uint8`: ``pixel_values`` and ``image_grid_thw`` of cached images."""
        return self.image_inputs_uint8(images)

    def split_image_inputs(self, inputs: dict[str, "torch.Tensor"]) -> list[dict[str, "torch.Tensor"]]:
        """One image at a time: its grid row and its ``t x h x w`` rows of patches."""
        grid = inputs["image_grid_thw"]
        patches = inputs["pixel_values"].split(grid.prod(-1).tolist())
        return [{"pixel_values": p, "image_grid_thw": grid[i:i + 1]} for i, p in enumerate(patches)]

    def pixel_settings(self) -> dict[str, Any]:
        """Every setting of the image processor (its ``to_dict()``), which alone turns a file into
        the cached uint8 image: a changed bound, resample filter or factor changes the key."""
        return {"settings": {"class": type(self.image_processor).__name__, **self.image_processor.to_dict()},
                "uint8": True}

    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        raise NotImplementedError(
            "qwen2_vl images are variable-length patch sequences with a grid per image, not a [N, 3, H, W] tensor: "
            "use adapter.image_inputs(paths), which returns pixel_values and image_grid_thw"
        )

    def _prompt_inputs(self, image_paths: Sequence[str]) -> dict[str, "torch.Tensor"]:
        """The grids of a prompt's images from the file headers (what the processor gives them;
        no pixel decode): all the rope index reads."""
        import torch

        grid = torch.tensor([self.images.grid(path) for path in image_paths], dtype=torch.long).reshape(-1, 3)
        return {"image_grid_thw": grid}

    # -- model (the hooks of models/hooks.py) ------------------------------------------------------
    def generation_class(self) -> type:
        """The class of the checkpoint's ``model_type``."""
        return model_classes(self.model_type)

    @property
    def _dummy_image_inputs(self) -> dict[str, "torch.Tensor"]:
        """One blank image of the smallest grid (1 x merge x merge patches)."""
        import torch

        merge = int(self.model_config.vision_config.spatial_merge_size)
        return {"pixel_values": torch.zeros(merge * merge, self.images.patch_dim),
                "image_grid_thw": torch.tensor([[1, merge, merge]], dtype=torch.long)}


def _override_pixels(image_processor: Any, config: ModelConfig) -> None:
    """Apply ``model.qwen2_vl.min_pixels`` / ``max_pixels`` to a loaded processor (its ``size``)."""
    settings = config.settings
    if settings.min_pixels is None and settings.max_pixels is None:
        return
    from transformers.image_utils import SizeDict

    size = dict(image_processor.size)
    if settings.min_pixels is not None:
        size["shortest_edge"] = int(settings.min_pixels)
    if settings.max_pixels is not None:
        size["longest_edge"] = int(settings.max_pixels)
    image_processor.size = SizeDict(**size)

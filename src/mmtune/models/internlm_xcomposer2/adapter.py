"""The mmtune adapter of InternLM-XComposer2: the official fine-tuning chat template and labels,
image preprocessing, loading native and official checkpoints, module groups.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from mmtune.core.dialogue import Image
from mmtune.models._utils import (
    Piece,
    PieceText,
    Plan,
    build_random_model,
    check_template_words,
    deep_update,
    load_dtype_and_attention,
    state_fingerprint,
)
from mmtune.models.base import ModelAdapter, ModuleGroups, unwrap_model
from mmtune.models.config import FamilySettings, ModelConfig, positive_or_null
from mmtune.models.hooks import TransformersModelHooks
from mmtune.models.images import SquareImage, SquareImageAdapter
from mmtune.models.internlm_xcomposer2.configuration import InternLMXComposer2Config
from mmtune.models.internlm_xcomposer2.conversion import (
    is_native_checkpoint,
    load_official_checkpoint,
    native_config_from_official,
)
from mmtune.models.internlm_xcomposer2.modeling import InternLMXComposer2ForCausalLM
from mmtune.models.internlm_xcomposer2.tokenization import InternLM2Tokenizer, load_tokenizer
from mmtune.models.registry import register_adapter

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.core.dialogue import Dialogue

__all__ = [
    "InternLMXComposer2Adapter",
    "IMAGE_TOKEN",
    "TINY_ARCHITECTURE",
]


#: Added special token whose id is ``image_token_id`` (decoding only; text never produces it).
IMAGE_TOKEN = "<ImageHere>"
_START, _END = "[UNUSED_TOKEN_146]", "[UNUSED_TOKEN_145]"
_TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", _END, _START)  # ids 0..4: unk 0, bos 1, eos 2 as InternLM2
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# An XC2-shaped model that builds on a CPU in well under a second: 2 decoder layers
# with grouped-query attention (4 query heads, 2 key/value groups) and a 2-layer CLIP
# seeing 56 px images in 14 px patches (16 image tokens per image). Partial LoRA keeps
# the official scaling of 1.0 (alpha = r). The vocabulary size comes from the tokenizer.
TINY_ARCHITECTURE: dict[str, Any] = {
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "plora_r": 8,
        "plora_alpha": 8.0,
        "plora_dropout": 0.05,
        "rope_parameters": {"rope_type": "dynamic", "factor": 1.0, "rope_theta": 1_000_000.0},
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "projection_dim": 32,
        "hidden_act": "quick_gelu",
    },
}


def _strip_segments(segments) -> list:
    """A turn's segments with the turn's leading and trailing whitespace removed, as the
    official ``value.strip()`` on the text with its ``<ImageHere>`` placeholders does."""
    out = [s for s in segments if not isinstance(s, str) or s]
    while out and isinstance(out[0], str):
        out[0] = out[0].lstrip()
        if out[0]:
            break
        out.pop(0)
    while out and isinstance(out[-1], str):
        out[-1] = out[-1].rstrip()
        if out[-1]:
            break
        out.pop()
    return out


@dataclass
class InternLMXComposer2Settings(FamilySettings):
    """``model.internlm_xcomposer2``: input resolution and the labels after the last answer."""

    image_size: Optional[int] = None
    """Square input resolution; ``None`` takes the checkpoint's. An official checkpoint whose
    config does not state it needs it (490 for -vl-7b, 224 for -7b: the CLIP position
    embeddings are resized to it on load); a converted one refuses any other value."""
    label_final_eos: Optional[bool] = None
    """Put loss on the ``\\n`` and ``</s>`` after the last answer, as the official fine-tuning
    code does (its ``mask_human_targets``; what ``null`` means). ``false`` labels only each
    answer and its ``[UNUSED_TOKEN_145]``, the tokens generation stops at."""

    def problems(self, prefix: str) -> list[str]:
        return positive_or_null(self.image_size, f"{prefix}.image_size", "the checkpoint's value")


@register_adapter
class InternLMXComposer2Adapter(SquareImageAdapter, TransformersModelHooks, PieceText, ModelAdapter):
    """InternLM-XComposer2 adapter (official fine-tuning format).

    Rendering (no system prompt in the official fine-tuning data)::

        <s>[UNUSED_TOKEN_146]user\\n{text with images}[UNUSED_TOKEN_145]\\n
        [UNUSED_TOKEN_146]assistant\\n{answer}[UNUSED_TOKEN_145]\\n ... </s>

    Ids and labels as the official fine-tuning code (``conv2text``, ``interleav_wrap``,
    ``mask_human_targets``): turn texts stripped; labels on each answer and its
    ``[UNUSED_TOKEN_145]``, and on the ``\\n`` and ``</s>`` after the last answer
    (``model.internlm_xcomposer2.label_final_eos``, default on as the official code). Images are spliced
    with no marker tokens; text is tokenized in the official parts (split at images and
    special tokens). Images are always resized to a square, as the official model does
    (there is no aspect-ratio setting).

    In ``encode_dialogue`` / ``encode_many`` a leading system turn wins over
    ``system_prompt``; the default is no system prompt, as in the official fine-tuning data.
    """

    family = "internlm_xcomposer2"
    settings_class = InternLMXComposer2Settings
    default_lora_targets = ["wqkv", "wo", "w1", "w2", "w3"]
    #: official LoRA fine-tuning preset (peft ``LoraConfig`` keys)
    lora_preset: dict[str, Any] = {"r": 64, "lora_alpha": 64, "lora_dropout": 0.05}
    #: keeps LoRA off the vision tower and projector (their names never match anyway)
    lora_exclude_modules = r".*(vit|vision_proj).*"
    #: the official remote-code config of the VL variant (490 px, 1225 image tokens), so
    #: ``mmtune plan`` sizes it offline
    known_architectures = {
        "internlm/internlm-xcomposer2-vl-7b": {
            "model_type": "internlmxcomposer2", "vocab_size": 92544, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000,
            "rope_scaling": {"type": "dynamic", "factor": 1.0}, "img_size": 490,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        },
    }

    def __init__(self, config: ModelConfig):
        config.validate()
        self.config = config
        image_size = config.settings.image_size
        if config.path is None:
            arch = deep_update(TINY_ARCHITECTURE, config.architecture)
            vocab_size = int(arch["text_config"].pop("vocab_size", 512))
            from mmtune.testing.tokenizers import cached_tiny_tokenizer

            # a copy: the image token is added below, and the cached tokenizer is shared
            tokenizer = copy.deepcopy(
                cached_tiny_tokenizer(
                    _TINY_SPECIAL_TOKENS,
                    vocab_size=vocab_size,
                    unk_token="<unk>",
                    bos_token="<s>",
                    eos_token="</s>",
                    pad_token="</s>",  # InternLM2 pads with eos
                )
            )
            arch["text_config"]["vocab_size"] = len(tokenizer)
            if image_size is not None:
                arch["vision_config"]["image_size"] = int(image_size)
            self.model_config = InternLMXComposer2Config(**arch)
            self._official = False
        else:
            if config.architecture:
                raise ValueError(
                    f"model.architecture is only used for random-weight models (model.path null); "
                    f"got {sorted(config.architecture)} with model.path={config.path!r}"
                )
            self._local_path = _resolve_path(config.path)
            tokenizer = load_tokenizer(self._local_path, config.trust_remote_code)
            self._official = not is_native_checkpoint(self._local_path)
            if self._official:
                with open(os.path.join(self._local_path, "config.json")) as handle:
                    self.model_config = native_config_from_official(json.load(handle), image_size=image_size)
            else:
                self.model_config = InternLMXComposer2Config.from_pretrained(self._local_path)
                size = self.model_config.vision_config.image_size
                if image_size is not None and image_size != size:
                    raise ValueError(
                        f"model.internlm_xcomposer2.image_size={image_size} but the checkpoint {config.path} was "
                        f"converted for {size} px; leave it null or convert the official checkpoint again"
                    )
        self.image_token_id = int(self.model_config.image_token_id)
        if IMAGE_TOKEN not in tokenizer.get_vocab():
            tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
        if tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) != self.image_token_id:
            raise ValueError(
                f"{IMAGE_TOKEN} has id {tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)} in the tokenizer but the model "
                f"config's image_token_id is {self.image_token_id} (text vocab {self.model_config.text_config.vocab_size},"
                f" tokenizer {len(tokenizer)}); the tokenizer and checkpoint of {config.path} do not belong together"
            )
        self.tokenizer = tokenizer
        ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (_START, _END)}
        missing = [tok for tok, i in ids.items() if i is None or i == tokenizer.unk_token_id]
        if missing or tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer of {config.path} lacks {missing or ''} bos/eos tokens needed by the XC2 template"
            )
        self.start_id, self.end_id = int(ids[_START]), int(ids[_END])
        check_template_words(tokenizer, ("user", "assistant"), config.path)
        self._header_length = len(self._tokenize_many(["assistant\n"])[0])
        self.stop_token_ids = [int(tokenizer.eos_token_id), self.end_id]
        self.num_image_tokens = self.model_config.num_image_tokens
        self.image_size = self.model_config.vision_config.image_size
        # the official torchvision Resize on PIL inputs: a square bicubic resize, no crop
        self.image_transform = SquareImage(self.image_size)

    # -- saving / caching ---------------------------------------------------------------------
    def save_pretrained(self, directory: str) -> None:
        """Write the tokenizer next to a saved model, so ``ModelConfig(path=directory)`` reloads both."""
        self.tokenizer.save_pretrained(directory)

    def fingerprint(self) -> str:
        """A short hash of everything that changes encoded ids or lengths (for length caches)."""
        state = {
            "family": self.family,
            "path": self.config.path,
            "architecture": self.config.architecture,
            "image_size": self.image_size,
            "num_image_tokens": self.num_image_tokens,
            "vocab": len(self.tokenizer),
            "tokenizer": getattr(self.tokenizer, "name_or_path", ""),
            "template": "xc2-v2",  # official stripping and parts
            "tokenizer_class": type(self.tokenizer).__name__,
        }
        return state_fingerprint(state)

    # -- rendering ----------------------------------------------------------------------------
    def _pieces(
        self, dialogue: "Dialogue", system_prompt: str | None, train_on: str, add_generation_prompt: bool
    ) -> Plan:
        # The official conv2text + interleav_wrap: every turn text stripped, then
        #   [146]user\n{text}[145]\n[146]assistant\n{answer}[145]\n ... </s>
        # tokenized in parts split at images and special tokens. The "\n" after each [145]
        # opens the next turn here (the same ids), so the one after the last kept answer
        # goes with the final </s> whatever truncation keeps.
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns = list(dialogue.turns)
        system = system_prompt or ""
        if turns and turns[0].role == "system":
            if turns[0].images:
                raise ValueError(f"dialogue {dialogue.id!r}, turn 0: a system turn cannot hold images")
            system = turns[0].text
            turns = turns[1:]
        prefix = [Piece("ids", (int(self.tokenizer.bos_token_id),))]
        newline: list[Piece] = []  # "\n" before a turn's [146], after the first one
        if system:
            prefix += [Piece("ids", (self.start_id,)), Piece("text", "system\n" + system.strip()),
                       Piece("ids", (self.end_id,))]  # fmt: skip
            newline = [Piece("text", "\n")]
        last_assistant = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        rendered: list[tuple[str, list[Piece]]] = []
        for index, turn in enumerate(turns):
            if turn.role == "user":
                pieces = [*newline, Piece("ids", (self.start_id,))]
                text = "user\n"
                for segment in _strip_segments(turn.segments):
                    if isinstance(segment, Image):
                        pieces += [Piece("text", text), Piece("image", segment)]
                        text = ""
                    else:
                        text += segment
                pieces += [Piece("text", text), Piece("ids", (self.end_id,))]
            elif turn.role == "assistant":
                if turn.images:
                    raise ValueError(
                        f"dialogue {dialogue.id!r}, turn {index}: assistant turns cannot hold images in the "
                        "XComposer2 format; move the image into the user turn"
                    )
                trainable = train_on == "all_assistant" or index == last_assistant
                # official labels start 6 tokens after the user's [145]: "\n", [146] and the
                # first 3 tokens of "assistant\n{answer}" (the header, 3 tokens in
                # InternLM2's vocabulary) stay unlabelled
                pieces = [
                    *newline,
                    Piece("ids", (self.start_id,)),
                    Piece("text", "assistant\n" + turn.text.strip(), trainable, plain=self._header_length),
                    Piece("ids", (self.end_id,), trainable),
                ]
            else:
                raise ValueError(
                    f"dialogue {dialogue.id!r}, turn {index}: role {turn.role!r} is not allowed after the first "
                    "turn; only 'user' and 'assistant' alternate (a 'system' turn must come first)"
                )
            newline = [Piece("text", "\n")]
            rendered.append((turn.role, pieces))
        if add_generation_prompt:
            if not turns or turns[-1].role != "user":
                raise ValueError(f"dialogue {dialogue.id!r}: add_generation_prompt needs a final user turn")
            suffix = [*newline, Piece("ids", (self.start_id,)), Piece("text", "assistant\n")]
        else:
            ends_with_answer = bool(turns) and turns[-1].role == "assistant"
            label = ends_with_answer and self.config.settings.label_final_eos is not False  # null: as official
            suffix = [*[Piece("text", "\n", label) for _ in newline],
                      Piece("ids", (int(self.tokenizer.eos_token_id),), label)]  # fmt: skip
        return prefix, rendered, suffix

    def _tokenize_many(self, texts: list[str]) -> list[list[int]]:
        if isinstance(self.tokenizer, InternLM2Tokenizer):
            return self.tokenizer.encode_texts(texts)
        # split_special_tokens: control-token strings inside dialogue text stay plain text
        return self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"] if texts else []

    # -- images -------------------------------------------------------------------------------
    def image_token_count(self, image: Image) -> int:
        # fixed for a square resize: never opens the file
        return self.num_image_tokens

    def normalize_uint8(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [..., 3, S, S] -> float32 pixel values normalised with CLIP mean / std, in the
        official order (torchvision's ``ToTensor`` then ``Normalize``: divide, subtract, divide)."""
        mean = torch.tensor(_CLIP_MEAN, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(_CLIP_STD, dtype=torch.float32).view(3, 1, 1)
        return (pixels.to(torch.float32) / 255.0 - mean) / std

    # -- model --------------------------------------------------------------------------------
    def load_model(self, **kwargs: Any) -> nn.Module:
        """Load the checkpoint (native or official) or build the random-weight model (``path`` None).

        Keyword arguments: ``torch_dtype`` / ``attn_implementation`` (default from the
        ModelConfig), ``seed`` (random-weight model only); others go to ``from_pretrained``
        of a native checkpoint.
        """
        dtype, attn = load_dtype_and_attention(kwargs, self.config)
        seed = kwargs.pop("seed", 0)
        if kwargs.get("quantization_config") is not None:
            raise NotImplementedError(
                "4-bit/8-bit loading (peft.method=qlora) is not supported for InternLM-XComposer2: bitsandbytes "
                "would replace the Partial LoRA layers (wqkv/wo/w1/w2/w3) with quantized layers that have no "
                "image-token branch. Use peft.method=lora."
            )
        if self.config.path is None:
            return build_random_model(
                InternLMXComposer2ForCausalLM, self.model_config, seed=seed, attn_implementation=attn, dtype=dtype
            )
        if self._official:
            model = load_official_checkpoint(
                self._local_path, image_size=self.image_size, dtype=dtype, attn_implementation=attn
            )
            self.model_config = model.config
            return model
        return InternLMXComposer2ForCausalLM.from_pretrained(
            self._local_path, dtype=dtype, attn_implementation=attn, **kwargs
        )

    @classmethod
    def meta_model(cls, config: ModelConfig, checkpoint_config: dict[str, Any] | None) -> tuple[nn.Module, ModuleGroups]:
        """A native or an official checkpoint's model on the meta device (see the base class);
        an official config gets Partial LoRA rank 256, as in the released weights."""
        if checkpoint_config is None:
            return super().meta_model(config, checkpoint_config)
        if checkpoint_config.get("model_type") == InternLMXComposer2Config.model_type:
            model_config = InternLMXComposer2Config.from_dict(checkpoint_config)
        else:  # the official remote-code config
            model_config = native_config_from_official(checkpoint_config, image_size=config.settings.image_size, plora_r=256)
        with torch.device("meta"):
            model = InternLMXComposer2ForCausalLM(model_config)
        return model, _module_groups(model)

    def module_groups(self, model: nn.Module) -> ModuleGroups:
        return _module_groups(unwrap_model(model, InternLMXComposer2ForCausalLM))

    def generation_class(self) -> type:
        return InternLMXComposer2ForCausalLM

    @property
    def _dummy_image_inputs(self) -> dict[str, torch.Tensor]:
        """One blank image at the vision tower's resolution (the dummy vision pass)."""
        vision = self.model_config.vision_config
        return {"pixel_values": torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)}


def _module_groups(model: InternLMXComposer2ForCausalLM) -> ModuleGroups:
    return ModuleGroups(vision=[model.vit], projector=[model.vision_proj], language_model=[model.model, model.output])


def _resolve_path(path: str) -> str:
    """A local directory for ``path`` (a directory, or a hub id resolved through the local cache)."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.model", "*.safetensors", "*.bin", "*.txt"])
    except Exception as err:  # noqa: BLE001
        raise FileNotFoundError(
            f"model.path={path!r} is not a local directory and could not be fetched from the hub ({err}); "
            "download the checkpoint and point model.path at the directory"
        ) from err

"""LLaVA-1.5 (Vicuna v1 template, CLIP ViT-L/14-336, 2-layer MLP projector) on transformers'
``LlavaForConditionalGeneration``.

Rendering follows the original LLaVA-1.5 ``conv_vicuna_v1`` template::

    <s>{system} USER: {user turn} ASSISTANT: {answer}</s>USER: {user turn} ASSISTANT: {answer}</s>

(system "A chat between a curious user and an artificial intelligence assistant. ...").
Images stand where their placeholders were, each as ``num_image_tokens`` copies of the
``<image>`` token (576 for 336 px CLIP-L/14 with the CLS feature dropped). Ids and labels
equal the official preprocessing (``preprocess_v1`` + ``tokenizer_image_token``) token for
token: the prompt is encoded in chunks split at images and ``</s>``, each starting with
SentencePiece's word marker, with the checkpoint's ``tokenizer.model``, or, for a checkpoint
that ships only ``tokenizer.json``, with the SentencePiece model rebuilt from it
(:func:`~mmtune.models._utils.sentencepiece_from_fast_tokenizer`; the fast tokenizer alone
differs where spaces meet words). Labels cover each answer and its ``</s>`` (see ``_text`` /
``_pieces`` for how pieces are cut so that piece-wise encoding equals the official
chunk-wise one).

With ``ModelConfig.path = None`` the adapter builds a random-weight tiny LLaVA (Llama text
model + CLIP vision tower, 2 layers each) with a built-in byte-level tokenizer; its
sizes come from ``ModelConfig.architecture`` (``text_config`` / ``vision_config`` /
top-level LlavaConfig keys override :data:`TINY_ARCHITECTURE`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from mmtune.core.dialogue import Image
from mmtune.models._utils import (
    Piece,
    PieceText,
    Plan,
    check_template_words,
    deep_update,
    find_sentencepiece_model,
    load_sentencepiece,
    sentencepiece_from_fast_tokenizer,
    state_fingerprint,
)
from mmtune.models.config import FamilySettings, positive_or_null
from mmtune.models.encoder import Encoder
from mmtune.models.images import SquareImage, SquareImageAdapter
from mmtune.models.registry import register_adapter
from mmtune.models.vicuna import VICUNA_V1_CHAT_TEMPLATE, VICUNA_V1_SYSTEM, vicuna_v1_chat_template

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mmtune.core.dialogue import Dialogue

log = logging.getLogger(__name__)

__all__ = [
    "VICUNA_V1_SYSTEM",
    "VICUNA_V1_CHAT_TEMPLATE",
    "vicuna_v1_chat_template",
    "TINY_ARCHITECTURE",
    "TINY_SPECIAL_TOKENS",
    "LlavaAdapter",
]

TINY_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<image>", "<pad>")

# A LLaVA-shaped model small enough to build on a CPU in well under a second. The vision
# tower sees 56 px images in 14 px patches: 16 image tokens per image.
TINY_ARCHITECTURE: dict[str, Any] = {
    "text_config": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "projection_dim": 32,
    },
    "projector_hidden_act": "gelu",
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
}


def _merge_text(segments) -> list:
    """Adjacent text segments joined (the official prompt is one string)."""
    out: list = []
    for segment in segments:
        if isinstance(segment, str) and out and isinstance(out[-1], str):
            out[-1] += segment
        elif not isinstance(segment, str) or segment:
            out.append(segment)
    return out


@dataclass
class LlavaSettings(FamilySettings):
    """``model.llava``: LLaVA-1.5's image preprocessing."""

    image_aspect_ratio: Optional[str] = None
    """``pad`` to a square with the mean colour (as the original training did; what ``null``
    means) or ``resize`` (stretch)."""
    image_size: Optional[int] = None
    """Square input resolution of a random-weight model's vision tower; ``None`` takes the
    checkpoint's (a checkpoint refuses any other value)."""

    def problems(self, prefix: str) -> list[str]:
        problems = positive_or_null(self.image_size, f"{prefix}.image_size", "the checkpoint's value")
        if self.image_aspect_ratio not in (None, "pad", "resize"):
            problems.append(f"{prefix}.image_aspect_ratio={self.image_aspect_ratio!r}: use 'pad' or 'resize' (or null)")
        return problems


@register_adapter
class LlavaAdapter(SquareImageAdapter, PieceText, Encoder):
    """LLaVA-1.5: the one encoder (:mod:`mmtune.models.encoder`) with the stages where the official
    training code differs from the processor replaced: the profile (a random-weight tiny model, or a
    checkpoint's tokenizer and config), the images (pad to a square with the mean colour, cached as
    squared uint8 images) and the text (Vicuna v1 turns in SentencePiece chunks). Positions, model
    hooks and the image check against the processor are the encoder's.

    ``encode_dialogue`` / ``encode_many`` render with the Vicuna v1 template: a leading
    system turn of the dialogue wins over ``system_prompt``; ``system_prompt`` (``""`` =
    none) replaces the Vicuna default.
    """

    family = "llava"
    settings_class = LlavaSettings
    # The language model's linear layers, as the original LLaVA LoRA scripts targeted
    # (find_all_linear_names skipped the vision tower and projector). These names also
    # occur in CLIP's attention, so pair them with ``lora_exclude_modules``.
    default_lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    #: peft ``exclude_modules`` regex keeping LoRA off the vision tower and projector
    lora_exclude_modules = r".*(vision_tower|multi_modal_projector).*"
    text_authority = "LLaVA-1.5's training code (conv_vicuna_v1, preprocess_v1, tokenizer_image_token)"
    pixel_tolerance = 1e-6  # normalize_uint8: one multiply-add per value, within 1e-6 of the processor's
    #: the public LLaVA-1.5 checkpoints the shipped configs name (``mmtune plan`` sizes them offline)
    known_architectures = {
        "llava-hf/llava-1.5-7b-hf": {
            "model_type": "llava",
            "text_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                            "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                              "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                              "patch_size": 14, "projection_dim": 768},
            "vision_feature_layer": -2,
            "image_token_index": 32000,
        },
        "llava-hf/llava-1.5-13b-hf": {
            "model_type": "llava",
            "text_config": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824,
                            "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
                            "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                              "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336,
                              "patch_size": 14, "projection_dim": 768},
            "vision_feature_layer": -2,
            "image_token_index": 32000,
        },
    }

    def _load_profile(self) -> None:
        """The tokenizer and model config: a random-weight tiny LLaVA's (``model.path=null``, sizes
        from ``model.architecture``) or the checkpoint's; the image and stop tokens checked against them."""
        from transformers import AutoConfig, AutoProcessor, LlavaConfig

        config, settings = self.config, self.config.settings
        if config.path is None:
            arch = deep_update(TINY_ARCHITECTURE, config.architecture)
            vocab_size = int(arch["text_config"].pop("vocab_size", 512))
            if settings.image_size is not None:
                arch["vision_config"]["image_size"] = int(settings.image_size)
            from mmtune.testing.tokenizers import cached_tiny_tokenizer

            self.tokenizer = cached_tiny_tokenizer(
                TINY_SPECIAL_TOKENS,
                vocab_size=vocab_size,
                unk_token="<unk>",
                bos_token="<s>",
                eos_token="</s>",
                pad_token="<pad>",
                chat_template=VICUNA_V1_CHAT_TEMPLATE,
            )
            arch["text_config"]["vocab_size"] = len(self.tokenizer)
            arch["text_config"].setdefault("pad_token_id", self.tokenizer.pad_token_id)
            arch["text_config"].setdefault("bos_token_id", self.tokenizer.bos_token_id)
            arch["text_config"].setdefault("eos_token_id", self.tokenizer.eos_token_id)
            arch.setdefault("image_token_id", self.tokenizer.convert_tokens_to_ids("<image>"))
            self.model_config = LlavaConfig(**arch)
            self._source_image_processor = None
        else:
            processor = AutoProcessor.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
            self.tokenizer = processor.tokenizer
            self.model_config = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
            if not hasattr(self.model_config, "vision_config") or not hasattr(self.model_config, "text_config"):
                raise ValueError(
                    f"{config.path} is not a LLaVA checkpoint (config type {type(self.model_config).__name__}); "
                    "use model.family=auto for other image-text models"
                )
            self._source_image_processor = processor.image_processor
            size = self.model_config.vision_config.image_size
            if settings.image_size is not None and settings.image_size != size:
                raise ValueError(
                    f"model.llava.image_size={settings.image_size} but the checkpoint {config.path} was trained at "
                    f"{size} px; leave model.llava.image_size null for LLaVA checkpoints"
                )
        image_token = "<image>"
        self.image_token_id = int(self.model_config.image_token_id)
        if self.tokenizer.convert_ids_to_tokens(self.image_token_id) != image_token:
            raise ValueError(
                f"the config's image_token_id {self.image_token_id} is "
                f"{self.tokenizer.convert_ids_to_tokens(self.image_token_id)!r} in the tokenizer, expected "
                f"{image_token!r}; the tokenizer and model config of {config.path or 'model.architecture'} do not "
                "belong together"
            )
        if self.tokenizer.eos_token_id is None or self.tokenizer.bos_token_id is None:
            raise ValueError(f"the tokenizer of {config.path} needs bos and eos tokens for the Vicuna v1 template")
        self._bos_id = int(self.tokenizer.bos_token_id)
        self._eos_id = int(self.tokenizer.eos_token_id)
        self.stop_token_ids = [self._eos_id]

    def _setup_images(self) -> None:
        """LLaVA-1.5's "pad": expand to a square with the mean colour, then the CLIP resize/crop (a
        no-op crop on a square), with the checkpoint's mean and std; ``resize`` stretches instead."""
        from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

        pad = (self.config.settings.image_aspect_ratio or "pad") == "pad"  # LLaVA-1.5 training padded to a square
        source = self._source_image_processor
        size = self.model_config.vision_config.image_size
        mean = list(getattr(source, "image_mean", None) or (0.48145466, 0.4578275, 0.40821073))
        std = list(getattr(source, "image_std", None) or (0.26862954, 0.26130258, 0.27577711))
        self.image_processor = LlavaImageProcessorPil(
            size={"shortest_edge": size},
            crop_size={"height": size, "width": size},
            image_mean=mean,
            image_std=std,
            do_pad=pad,
        )
        if not pad:
            # square resize without crop, so the whole image stays visible
            self.image_processor.size = {"height": size, "width": size}
            self.image_processor.do_center_crop = False
        # the same pixels as that processor (checked at start-up: the authority stage), decoded and
        # squared once into the pixel cache; normalize_uint8 does the rest per batch
        self.image_transform = SquareImage(size, pad=pad, fill=tuple(int(x * 255) for x in mean))
        vc = self.model_config.vision_config
        strategy = self.model_config.vision_feature_select_strategy
        self.num_image_tokens = (vc.image_size // vc.patch_size) ** 2 + (0 if strategy == "default" else 1)

    def _setup_text(self) -> None:
        """The SentencePiece model the official code tokenized with, and where its word marks fall."""
        config = self.config
        # LLaVA-1.5 tokenized with the slow SentencePiece tokenizer: use the checkpoint's
        # model file, else the model rebuilt from its fast tokenizer (which by itself
        # differs from SentencePiece where spaces meet words).
        sp_path = find_sentencepiece_model(self.tokenizer, config.path if config.path and os.path.isdir(config.path) else None)
        self._sp = load_sentencepiece(sp_path, self.tokenizer) if sp_path else sentencepiece_from_fast_tokenizer(self.tokenizer)
        self._sp_path = sp_path
        self._sp_source = "tokenizer.model" if sp_path else ("rebuilt from tokenizer.json" if self._sp else None)
        # SentencePiece puts a word-start marker ("▁", its "dummy prefix") before every
        # separately encoded string; the official code encodes the prompt in chunks split at
        # images and special tokens, so each chunk starts with that marker.
        first = [self._sp.id_to_piece(i) for i in self._sp.encode("a")] if self._sp else (
            self.tokenizer.convert_ids_to_tokens(self.tokenizer("a", add_special_tokens=False)["input_ids"][:1]))
        self._dummy_prefix = bool(first) and first[0].startswith("\u2581")
        if self._dummy_prefix and self._sp is None:
            log.warning(
                "%s: no tokenizer.model and a fast tokenizer that is not a SentencePiece conversion mmtune can "
                "rebuild; encoding with the fast tokenizer, whose ids can differ from LLaVA-1.5's SentencePiece "
                "encoding where spaces meet words. Put the checkpoint's tokenizer.model next to it for exact ids.",
                config.path or "model.architecture",
            )
        self._template_ids: dict[str, tuple[int, ...]] = {}
        # the lone word marker that a chunk ending in a space ends with ("USER: " before an image)
        with_space = self._encode_texts(["a ", "a"])
        self._space_ids = tuple(with_space[0][len(with_space[1]) :]) if self._dummy_prefix else ()
        check_template_words(self.tokenizer, ("USER", "ASSISTANT"), config.path)

    # -- processor for saving ---------------------------------------------------------------
    @functools.cached_property
    def processor(self):
        """A ``LlavaProcessor`` (tokenizer + image processor + Vicuna v1 chat template).

        ``adapter.save_pretrained(dir)`` writes it next to a saved model so that
        ``ModelConfig(family="llava", path=dir)`` loads the checkpoint back.
        """
        from transformers import LlavaProcessor

        vc = self.model_config.vision_config
        return LlavaProcessor(
            image_processor=self.image_processor,
            tokenizer=self.tokenizer,
            patch_size=vc.patch_size,
            vision_feature_select_strategy=self.model_config.vision_feature_select_strategy,
            # what this adapter trains with, whatever template the source checkpoint had
            chat_template=self.chat_template,
            num_additional_image_tokens=1,
        )

    @property
    def chat_template(self) -> str:
        """The Jinja template saved with checkpoints (see :func:`vicuna_v1_chat_template`)."""
        return vicuna_v1_chat_template(marker_after_special=self._dummy_prefix)

    def save_pretrained(self, directory: str) -> None:
        """Write the processor (tokenizer, image processor, chat template) to ``directory``,
        with the SentencePiece model the text was encoded with."""
        import shutil

        self.tokenizer.chat_template = self.chat_template
        self.processor.save_pretrained(directory)
        target = os.path.join(directory, "tokenizer.model")
        if self._sp_path and not os.path.exists(target):
            shutil.copy(self._sp_path, target)

    def fingerprint(self) -> str:
        """A short hash of everything that changes encoded ids or lengths (for length caches)."""
        state = {
            "family": self.family,
            "path": self.config.path,
            "architecture": self.config.architecture,
            "image_size": self.model_config.vision_config.image_size,
            "num_image_tokens": self.num_image_tokens,
            "vocab": len(self.tokenizer),
            "tokenizer": getattr(self.tokenizer, "name_or_path", ""),
            "dummy_prefix": self._dummy_prefix,
            "template": hashlib.sha1(self.chat_template.encode()).hexdigest(),
            "sentencepiece": self._sp_source,
        }
        return state_fingerprint(state)

    # -- rendering ----------------------------------------------------------------------------
    # The official code (``conv_vicuna_v1.get_prompt`` + ``tokenizer_image_token``) builds
    #     {system} USER: {user} ASSISTANT: {answer}</s>USER: {user} ASSISTANT: {answer}</s>
    # and tokenizes it in chunks split at each <image> and special token (</s>): each chunk
    # is one SentencePiece call, so it starts with the word marker "▁". Within a chunk, this
    # adapter cuts pieces only right after a non-space character, before a space, where
    # SentencePiece starts a new word anyway; such a piece is encoded without its first
    # space (the marker of its first word stands for it). The text of a user turn and the
    # following " ASSISTANT:" stay one piece, since a user text that ends with spaces forms
    # one word with them. Labels: every answer and its </s> (what ``preprocess_v1``'s
    # round-length arithmetic labels).
    def _text(self, text: str, *, chunk_start: bool, trainable: bool = False, template: bool = False) -> Piece:
        if self._dummy_prefix and not chunk_start:
            if not text.startswith(" "):
                raise AssertionError(f"piece {text!r} must start with the separator space")  # a template bug
            text = text[1:]
            if not text:  # a chunk that ends in its separator space: a lone word marker
                return Piece("ids", self._space_ids, trainable)
        if template:  # headers and the system prompt repeat: tokenized once, then memoized
            ids = self._template_ids.get(text)
            if ids is None:
                ids = tuple(self._encode_texts([text])[0])
                if len(self._template_ids) < 4096:  # bounded: data may carry many system prompts
                    self._template_ids[text] = ids
            return Piece("ids", ids, trainable)
        return Piece("text", text, trainable)

    def _pieces(
        self,
        dialogue: "Dialogue",
        system_prompt: str | None,
        train_on: str,
        add_generation_prompt: bool,
    ) -> Plan:
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns = list(dialogue.turns)
        system = VICUNA_V1_SYSTEM if system_prompt is None else system_prompt
        if turns and turns[0].role == "system":
            system = turns[0].text
            turns = turns[1:]
        prefix = [Piece("ids", (self._bos_id,))]
        # "{system} USER:": a system prompt ending in whitespace shares a word with " USER:"
        merge_header = bool(system) and system[-1].isspace()
        if system and not merge_header:
            prefix.append(self._text(system, chunk_start=True, template=True))
        last_assistant = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        rendered: list[tuple[str, list[Piece]]] = []
        chunk_start = not system or merge_header  # does the next piece start a tokenizer chunk?
        for index, turn in enumerate(turns):
            pieces: list[Piece] = []
            if turn.role == "user":
                header = (system if index == 0 and merge_header else "") + (" USER:" if index == 0 else "USER:")
                pieces.append(self._text(header, chunk_start=chunk_start, template=True))
                chunk_start = False
                segments = _merge_text(turn.segments)
                for k, segment in enumerate(segments):
                    sep = " " if k == 0 else ""
                    if isinstance(segment, Image):
                        if k == 0:
                            pieces.append(self._text(" ", chunk_start=False, template=True))
                        pieces.append(Piece("image", segment))
                        chunk_start = True
                    else:
                        pieces.append(Piece("text", sep + segment, False))  # finished below
                        pieces[-1].plain = int(chunk_start)  # remembers where the piece starts
                        chunk_start = False
                if not segments:  # an empty user turn still gets its separator
                    pieces.append(Piece("text", " ", False))
                    pieces[-1].plain = 0
                answer_next = index + 1 < len(turns) and turns[index + 1].role == "assistant"
                if answer_next or (add_generation_prompt and index == len(turns) - 1):
                    if pieces[-1].kind == "text":
                        pieces[-1].value += " ASSISTANT:"
                    else:
                        pieces.append(Piece("text", " ASSISTANT:", False))
                        pieces[-1].plain = int(chunk_start)
                    chunk_start = False
                pieces = [self._finish_text(p) for p in pieces]
            elif turn.role == "assistant":
                if turn.images:
                    raise ValueError(
                        f"dialogue {dialogue.id!r}, turn {index}: assistant turns cannot hold images in the "
                        "Vicuna v1 template; move the image into the user turn"
                    )
                if index == 0 or turns[index - 1].role != "user":
                    raise ValueError(
                        f"dialogue {dialogue.id!r}, turn {index}: an assistant turn must follow a user turn in the "
                        "Vicuna v1 template"
                    )
                trainable = train_on == "all_assistant" or index == last_assistant
                pieces.append(self._text(" " + turn.text, chunk_start=False, trainable=trainable))
                pieces.append(Piece("ids", (self._eos_id,), trainable))
                chunk_start = True
            else:
                raise ValueError(
                    f"dialogue {dialogue.id!r}, turn {index}: role {turn.role!r} is not allowed after the first "
                    "turn; only 'user' and 'assistant' alternate (a 'system' turn must come first)"
                )
            rendered.append((turn.role, pieces))
        if add_generation_prompt and (not turns or turns[-1].role != "user"):
            raise ValueError(
                f"dialogue {dialogue.id!r}: add_generation_prompt needs the dialogue to end with a user turn"
            )
        return prefix, rendered, []

    def _finish_text(self, piece: Piece) -> Piece:
        """A user-turn text piece (``plain`` = 1 when it starts a chunk) -> its final form."""
        if piece.kind != "text":
            return piece
        return self._text(piece.value, chunk_start=bool(piece.plain))

    def _encode_texts(self, texts: list[str]) -> list[Sequence[int]]:
        """Ids of each text encoded alone (SentencePiece's own encoding when available)."""
        if not texts:
            return []
        if self._sp is not None:
            return self._sp.encode(texts)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            # the Rust tokenizer directly: same ids, without building a BatchEncoding
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _tokenize_many(self, texts: list[str]) -> list[Sequence[int]]:
        return self._encode_texts(texts)

    # -- images -------------------------------------------------------------------------------
    def image_token_count(self, image: Image) -> int:
        # fixed for CLIP at one resolution: never opens the file
        return self.num_image_tokens

    def normalize_uint8(self, pixels: "torch.Tensor") -> "torch.Tensor":
        """uint8 [..., 3, S, S] -> normalised float32 pixel values (CLIP mean / std).

        One conversion and two in-place passes (x * (1/255/std) - mean/std), the rescale and
        normalise of the transformers image processor in one: the collator normalises a
        whole batch at once, which is most of the cost of a cached image.
        """
        import torch

        p = self.image_processor
        std = torch.tensor(p.image_std, dtype=torch.float64)
        scale = (float(p.rescale_factor) / std).to(torch.float32).view(3, 1, 1)
        shift = (-torch.tensor(p.image_mean, dtype=torch.float64) / std).to(torch.float32).view(3, 1, 1)
        out = pixels.to(torch.float32)
        return out.mul_(scale).add_(shift)

    # -- model (the hooks of models/hooks.py) -----------------------------------------------
    def generation_class(self) -> type:
        from transformers import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration

    @property
    def _dummy_image_inputs(self) -> dict[str, "torch.Tensor"]:
        """One blank image at the vision tower's resolution (the dummy vision pass)."""
        import torch

        vc = self.model_config.vision_config
        return {"pixel_values": torch.zeros(1, vc.num_channels, vc.image_size, vc.image_size)}


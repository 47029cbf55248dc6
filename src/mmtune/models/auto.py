"""Generic adapter for ``AutoModelForImageTextToText`` checkpoints whose processor has a
chat template and whose only image input is ``pixel_values`` [N, 3, H, W] (LLaVA-1.5-style
checkpoints with any language model or vision tower, e.g. llava-hf's LLaVA-1.5 and
LLaVA-Interleave). Models that also need ``image_sizes`` / ``image_grid_thw`` (LLaVA-NeXT,
OneVision, Qwen2-VL: dynamic tiling and M-RoPE positions) are detected at start-up and
rejected with a clear error; they need a family adapter.

Turn segments come from the checkpoint's own chat template, without string surgery: the
adapter renders growing prefixes of the conversation (up to turn *i*, and up to turn *i*
plus the generation prompt), tokenizes each, and takes the difference of consecutive token
sequences as turn *i*'s tokens. An assistant turn's header is what the generation prompt
adds; its labelled part is everything the full turn adds after that (content and
end-of-turn tokens). This needs the template to be *prefix-stable* (rendering more turns
never changes the tokens of earlier ones); a template that is not (e.g. one that strips
the reasoning of earlier assistant turns) raises :class:`TemplateNotPrefixStableError`
naming the dialogue, turn and first differing token.

Images: the template renders one image placeholder token per image (``processor.image_token``);
each becomes ``n`` copies of it, ``n`` from the processor's ``_get_num_multimodal_tokens``
for the image's size, read from the file header (no pixel decode). At start-up the adapter
checks on a blank image that the processor expands a placeholder exactly that way;
processors that expand images into other token patterns are rejected with a clear error.
"""

from __future__ import annotations

import functools
import hashlib
from typing import TYPE_CHECKING, Any, Sequence

from mmtune.core.dialogue import Image
from mmtune.models._utils import load_dtype_and_attention, state_fingerprint
from mmtune.models.base import (
    EncodedDialogue,
    EncodedTurn,
    ImageChunk,
    ModelAdapter,
    ModuleGroups,
    TokenChunk,
    find_module_groups,
    unwrap_model,
)
from mmtune.models.config import ModelConfig
from mmtune.models.registry import register_adapter

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from mmtune.core.dialogue import Dialogue

__all__ = ["AutoAdapter", "TemplateNotPrefixStableError", "UnsupportedProcessorError"]



class TemplateNotPrefixStableError(ValueError):
    """Rendering more turns changed the tokens of earlier turns."""


class UnsupportedProcessorError(ValueError):
    """The processor does not expand an image into repeated copies of one image token."""


@register_adapter
class AutoAdapter(ModelAdapter):
    """Chat-template-driven adapter for transformers image-text-to-text models."""

    family = "auto"
    default_lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_exclude_modules = r".*(vision_tower|visual|vision_model|multi_modal_projector|connector|merger).*"

    def __init__(self, config: ModelConfig):
        from transformers import AutoConfig, AutoProcessor

        config.validate()
        if config.path is None:
            raise ValueError(
                "model.family=auto needs model.path: a checkpoint directory (or hub id) with a processor and a "
                "chat template; for a random-weight tiny model use model.family=llava with model.path=null"
            )
        self.config = config
        self.processor = AutoProcessor.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        problems = []
        if self.tokenizer is None:
            problems.append("its processor has no tokenizer")
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if not template:
            problems.append("its processor has no chat template (set processor.chat_template and save it)")
        image_token = getattr(self.processor, "image_token", None)
        if image_token is None:
            problems.append("its processor has no `image_token` attribute")
        if not hasattr(self.processor, "_get_num_multimodal_tokens"):
            problems.append("its processor cannot count image tokens from an image size (_get_num_multimodal_tokens)")
        if problems:
            raise UnsupportedProcessorError(
                f"model.path={config.path!r} cannot be used with model.family=auto: " + "; ".join(problems)
            )
        self.chat_template = template
        self.image_token = image_token
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(image_token))
        self.model_config = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
        eos = [self.tokenizer.eos_token_id]
        generation_eos = getattr(self.model_config, "eos_token_id", None)
        for value in generation_eos if isinstance(generation_eos, (list, tuple)) else [generation_eos]:
            if value is not None and value not in eos:
                eos.append(value)
        self.stop_token_ids = [int(i) for i in eos if i is not None]
        self._check_expansion()

    # -- helpers --------------------------------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        text = self.processor.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.chat_template
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @functools.lru_cache(maxsize=65536)
    def _count_for_size(self, height: int, width: int) -> int:
        data = self.processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
        counts = getattr(data, "num_image_tokens", None) or data["num_image_tokens"]
        return int(counts[0])

    def _check_expansion(self) -> None:
        from PIL import Image as PILImage

        blank = PILImage.new("RGB", (64, 48), (127, 127, 127))
        features = self.processor.image_processor(images=[blank], return_tensors="pt")
        extra_keys = sorted(k for k in features.keys() if k != "pixel_values")
        pixels = features.get("pixel_values")
        if extra_keys or pixels is None or pixels.ndim != 4:
            raise UnsupportedProcessorError(
                f"the image processor of {self.config.path!r} returns {sorted(features.keys())} "
                f"(pixel_values shape {None if pixels is None else tuple(pixels.shape)}); the auto adapter and "
                "the collator handle models whose only image input is pixel_values [N, 3, H, W] (LLaVA-1.5-style "
                "checkpoints). Models that also need image_sizes / image_grid_thw (LLaVA-NeXT, Qwen2-VL) need a "
                "family adapter."
            )
        expected = self._count_for_size(48, 64)
        ids = self.processor(text=self.image_token, images=[blank], return_tensors="pt")["input_ids"][0].tolist()
        run = sum(1 for i in ids if i == self.image_token_id)
        plain = self.tokenizer(self.image_token, add_special_tokens=False)["input_ids"]
        extra = [i for i in ids if i != self.image_token_id]
        added = [i for i in self.tokenizer("", add_special_tokens=True)["input_ids"]]
        if run != expected or plain != [self.image_token_id] or sorted(extra) != sorted(added):
            raise UnsupportedProcessorError(
                f"the processor of {self.config.path!r} expands {self.image_token!r} into {len(ids)} tokens "
                f"({run} copies of id {self.image_token_id}, expected {expected} and nothing else); the auto adapter "
                "supports processors that repeat one image token per image. Write a family adapter for this model."
            )

    def fingerprint(self) -> str:
        state = {
            "family": self.family,
            "path": self.config.path,
            "template": hashlib.sha1(self.chat_template.encode()).hexdigest(),
            "vocab": len(self.tokenizer),
            "image_processor": self.processor.image_processor.to_dict(),
        }
        return state_fingerprint(state)

    @staticmethod
    def _message(role: str, segments: Sequence[Any]) -> dict:
        content = [
            {"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s} for s in segments if s != ""
        ]
        return {"role": role, "content": content}

    def _split_images(self, dialogue_id: str, turn_index: int, ids: list[int], images: list[Image], trainable: bool):
        chunks: list = []
        start = 0
        found = 0
        for pos, token in enumerate(ids):
            if token != self.image_token_id:
                continue
            if pos > start:
                chunks.append(TokenChunk(tuple(ids[start:pos]), trainable))
            if found >= len(images):
                raise UnsupportedProcessorError(
                    f"dialogue {dialogue_id!r}, turn {turn_index}: the chat template renders more image tokens "
                    f"than the turn's {len(images)} images"
                )
            chunks.append(ImageChunk(images[found], self.image_token_count(images[found])))
            found += 1
            start = pos + 1
        if start < len(ids):
            chunks.append(TokenChunk(tuple(ids[start:]), trainable))
        if found != len(images):
            raise UnsupportedProcessorError(
                f"dialogue {dialogue_id!r}, turn {turn_index}: the chat template rendered {found} image tokens for "
                f"{len(images)} images; it must render one {self.image_token!r} per image"
            )
        return chunks

    def _delta(self, dialogue_id: str, turn_index: int, before: list[int], after: list[int], what: str) -> list[int]:
        if after[: len(before)] != before:
            pos = next((k for k, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            seen = self.tokenizer.decode(before[max(0, pos - 5) : pos + 5])
            now = self.tokenizer.decode(after[max(0, pos - 5) : pos + 5])
            raise TemplateNotPrefixStableError(
                f"dialogue {dialogue_id!r}, turn {turn_index}: the chat template of {self.config.path!r} is not "
                f"prefix-stable: adding {what} changes token {pos} ({seen!r} -> {now!r}). Labels cannot be "
                "derived from it; use a template that renders earlier turns identically, or a family adapter."
            )
        return after[len(before) :]

    # -- contract ---------------------------------------------------------------------------------
    def encode_dialogue(
        self,
        dialogue: "Dialogue",
        *,
        system_prompt: str | None = None,
        train_on: str = "all_assistant",
        add_generation_prompt: bool = False,
    ) -> EncodedDialogue:
        """Render with the checkpoint's chat template. ``system_prompt`` adds a system message
        when the dialogue has none (``None``/``""``: the template's own default)."""
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns = list(dialogue.turns)
        messages: list[dict] = []
        if turns and turns[0].role == "system":
            messages.append(self._message("system", turns[0].segments))
            turns = turns[1:]
        elif system_prompt:
            messages.append(self._message("system", (system_prompt,)))
        offset = len(messages)
        last_assistant = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=-1)
        all_messages = messages + [self._message(t.role, t.segments) for t in turns]
        previous: list[int] = []
        encoded_turns = []
        for index, turn in enumerate(turns):
            if turn.role not in ("user", "assistant"):
                raise ValueError(
                    f"dialogue {dialogue.id!r}, turn {index + offset}: role {turn.role!r} is not allowed here"
                )
            full = self._render(all_messages[: offset + index + 1], add_generation_prompt=False)
            if turn.role == "assistant":
                header_ids = self._render(all_messages[: offset + index], add_generation_prompt=True)
                header = self._delta(dialogue.id, index + offset, previous, header_ids, "the generation prompt")
                body = self._delta(dialogue.id, index + offset, header_ids, full, "the assistant turn")
                trainable = train_on == "all_assistant" or index == last_assistant
                chunks = self._split_images(dialogue.id, index + offset, header, [], False)
                chunks += self._split_images(dialogue.id, index + offset, body, list(turn.images), trainable)
            else:
                delta = self._delta(dialogue.id, index + offset, previous, full, "a user turn")
                chunks = self._split_images(dialogue.id, index + offset, delta, list(turn.images), False)
            encoded_turns.append(EncodedTurn(turn.role, chunks))
            previous = full
        suffix: list = []
        if add_generation_prompt:
            if not turns or turns[-1].role != "user":
                raise ValueError(
                    f"dialogue {dialogue.id!r}: add_generation_prompt needs the dialogue to end with a user turn"
                )
            prompt = self._render(all_messages, add_generation_prompt=True)
            suffix = self._split_images(
                dialogue.id, len(dialogue.turns), self._delta(dialogue.id, len(dialogue.turns), previous, prompt,
                                                              "the generation prompt"), [], False
            )
        return EncodedDialogue(dialogue.id, [], encoded_turns, suffix)

    def image_token_count(self, image: Image) -> int:
        from mmtune.core.images import image_size

        width, height = image_size(image.path)  # header only
        return self._count_for_size(height, width)

    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        from PIL import Image as PILImage

        images = []
        for path in paths:
            self.config.image_limits.check_file(path)  # from the header, before the decode
            with PILImage.open(path) as handle:
                images.append(handle.convert("RGB"))
        return self.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]

    def load_model(self, **kwargs: Any) -> "nn.Module":
        from transformers import AutoModelForImageTextToText

        dtype, attn = load_dtype_and_attention(kwargs, self.config)
        kwargs.pop("seed", None)
        return AutoModelForImageTextToText.from_pretrained(
            self.config.path,
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=self.config.trust_remote_code,
            **kwargs,
        )

    def module_groups(self, model: "nn.Module") -> ModuleGroups:
        """Vision tower and projector found by their transformers attribute names; every other
        module (language model, lm_head) is the language-model group."""
        return find_module_groups(model)

    def loss_modules(self, model: "nn.Module") -> tuple["nn.Module", "nn.Module"]:
        """transformers' ``model`` attribute (the multimodal body) and the output embeddings."""
        top = unwrap_model(model)
        body = getattr(top, "model", None)
        head = top.get_output_embeddings()
        if body is None or head is None:
            raise NotImplementedError(f"{type(top).__name__} has no `model` body or no output embeddings")
        return body, head

    def text_config(self, config: Any) -> Any:
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @functools.cached_property
    def _dummy_image_inputs(self) -> dict:
        from PIL import Image as PILImage

        blank = PILImage.new("RGB", (64, 64), (0, 0, 0))
        return dict(self.processor.image_processor(images=[blank], return_tensors="pt"))

    def vision_dummy_loss(self, model: "nn.Module") -> "torch.Tensor":
        """0 x the model's ``get_image_features`` on a blank image (see the base class)."""
        import torch

        top = unwrap_model(model)
        param = next(p for p in top.parameters() if p.is_floating_point())
        inputs = {
            k: (v.to(device=param.device, dtype=param.dtype) if v.is_floating_point() else v.to(param.device))
            for k, v in self._dummy_image_inputs.items()
            if isinstance(v, torch.Tensor)
        }
        features = top.get_image_features(**inputs)
        total = param.new_zeros(())
        stack = [features]
        while stack:
            item = stack.pop()
            if isinstance(item, torch.Tensor):
                total = total + item.float().sum()
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif hasattr(item, "pooler_output"):
                stack.append(item.pooler_output)
        return total * 0.0

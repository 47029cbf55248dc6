"""Any transformers image-text-to-text checkpoint, exact against its own processor.

For a checkpoint whose processor and chat template are in transformers (LLaVA-1.5,
InternVL, LLaVA-OneVision, LLaVA-NeXT, Gemma 3, Idefics3 / SmolVLM, Mistral 3, GLM-4.1V, Aya
Vision, ...), this adapter gives the tokens, image inputs and positions that
``processor(text=processor.apply_chat_template(messages), images=images)`` gives for the whole dialogue,
and labels the assistant turns as the template renders them:

- **text**: the dialogue's messages (image and text items in order, every text piece kept
  as written, empty pieces dropped) rendered by the checkpoint's chat template, growing one
  turn at a time; each turn's text is what rendering it adds. An assistant turn's header is
  what the generation prompt adds; its labelled part is everything the full turn adds after
  the longest common prefix with that (content and end-of-turn tokens). Where that part holds no
  generation stop token (GLM-4.1V's template ends an answer with the next turn's ``<|user|>``),
  the stop token the template renders right after the answer is labelled with it, and appended
  after the last answer, so the model learns to stop; where the template renders no stop token
  at all (llava-hf's LLaVA templates), start-up warns, and ``model.auto.answer_stop=eos``
  appends the tokenizer's EOS to every answer. Rendering more turns
  must never change the text of earlier ones, or :class:`TemplateNotPrefixStableError` names
  the dialogue, turn and first differing character. So that a long dialogue costs renders of
  a few turns each rather than of every prefix, a turn's text is taken from a window (the
  system message and the turns since the last multiple of four before it), where that gives
  the every-prefix result on probe dialogues (checked once per checkpoint) and the joined
  turns equal the whole dialogue's render (checked per dialogue); otherwise every prefix is
  rendered.
- **images**: each image placeholder (``processor.image_token``) is replaced by the text the
  processor itself puts there (``return_text_replacement_offsets``), which depends only on the
  image's size: it is computed once per size on a blank image, and the image's size is read
  from the file header (no pixel decode). The whole expanded text is tokenized once as the
  processor tokenizes it (no added special tokens when the template already starts with BOS),
  and every token goes to the turn, header / content part or image where it starts.
- **image inputs**: the processor called on one image at a time (what the pixel cache
  stores), joined for several images and samples per input as the processor joins them: at
  start-up the adapter calls the processor on two images together and one by one and finds,
  for every input, the concatenation axis or stack (with padding) that reproduces the joint
  call (:class:`~mmtune.models.base.InputJoin`); an input no join reproduces, or expansion
  text that depends on the other images, is refused then (:class:`UnsupportedProcessorError`).
- **token inputs**: the processor's text-aligned inputs (Gemma 3's ``token_type_ids``), 1 on
  the token ids the processor marks (found at start-up), computed per batch from the ids.
- **positions**: one running position, or, for a model whose transformers class has its own
  ``get_rope_index`` (M-RoPE: GLM-4.1V, Qwen2-VL), that function on the sample.
- **packed rows** of a model with sliding-window layers keep transformers' block mask; its
  sliding-window mask is taken as the full-attention one within the window
  (:func:`_packed_window_masks`: transformers misplaces Gemma 3's bidirectional image blocks there).

An image the processor refuses (too small, extreme aspect ratio) raises
:class:`UnsupportedImageError` naming file, dialogue and turn, so data validation skips or
refuses it per ``data.validation.mode``. A checkpoint whose classes need code shipped with
it is refused unless ``model.trust_remote_code`` is set.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from mmtune.core.dialogue import Image
from mmtune.core.images import CorruptImageError
from mmtune.core.images import UnsupportedImageError as BaseUnsupportedImageError
from mmtune.models._utils import load_dtype_and_attention, state_fingerprint
from mmtune.models.base import (
    EncodedDialogue,
    EncodedTurn,
    ImageChunk,
    InputJoin,
    ModelAdapter,
    ModuleGroups,
    TokenChunk,
    find_module_groups,
    unwrap_model,
)
from mmtune.models.config import FamilySettings, ModelConfig
from mmtune.models.checkpoint_guard import check_chat_template, check_model_folder
from mmtune.models.registry import register_adapter

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch
    from torch import nn

    from mmtune.core.dialogue import Dialogue

__all__ = ["AutoAdapter", "AutoSettings", "RemoteCodeError", "TemplateNotPrefixStableError", "UnsupportedImageError",
           "UnsupportedProcessorError"]

#: processor outputs that are text inputs, not image inputs
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                        "text_replacement_offsets"})

log = logging.getLogger(__name__)


class TemplateNotPrefixStableError(ValueError):
    """Rendering more turns changed the text of earlier turns."""


class UnsupportedProcessorError(ValueError):
    """The checkpoint's processor cannot be reproduced image by image (see the module doc)."""


class RemoteCodeError(ValueError):
    """The checkpoint needs code shipped with it and ``model.trust_remote_code`` is off."""


class UnsupportedImageError(BaseUnsupportedImageError):
    """An image the checkpoint's processor refuses (too small, extreme aspect ratio)."""


@dataclass
class _Span:
    """A character span of the expanded text: a turn's header / content part, or an image."""

    start: int
    end: int
    turn: int  # -1: the generation prompt
    trainable: bool = False
    image: Image | None = None


@dataclass
class _Tokens:
    """The tokens of a dialogue's expanded text and the spans of that text."""

    ids: list[int]
    starts: "np.ndarray"  # first character of each token in the expanded text ((0, 0): added by the tokenizer)
    ends: "np.ndarray"
    cores: dict[int, tuple[int, ...]]  # token position -> the image core's ids spliced in for that placeholder
    spans: list[_Span]


def _offsets(pairs: list[tuple[int, int]]) -> "np.ndarray":
    """A tokenizer's offset mapping as an ``[n, 2]`` int64 array."""
    import numpy as np

    flat = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
    return flat.reshape(-1, 2)


def _noise_image(width: int, height: int, seed: int):
    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return PILImage.fromarray(pixels, "RGB")


def _common_prefix(a: str, b: str, start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, known to be at least ``start``."""
    n = min(len(a), len(b))
    k = start
    while k < n and a[k] == b[k]:
        k += 1
    return k


def _packed_window_masks(module, args, kwargs, *, window: int):
    """Forward pre-hook of a language model with sliding-window layers: on a packed row (positions
    restarting, no cache), its sliding-window mask becomes its full-attention mask within the window.

    Why: transformers builds the full-attention mask of a packed row right (each sample causal,
    Gemma 3's images bidirectional by ``token_type_ids``), but composes the sliding one with the
    image-block overlay applied before the per-sample position remap, so on every sample after the
    first it reads the image blocks at the wrong tokens (Gemma 3: 1.3e-4 off the samples alone). A
    sliding layer's mask is the full one within the window (transformers: "AND(sliding_window,
    OR(causal, blockwise))"), and within one sample the window counts tokens, so this is each
    sample's own sliding mask."""
    import torch
    from transformers.masking_utils import find_packed_sequence_indices

    masks, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    cached = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(masks, dict) or cached is not None or positions is None:
        return None
    full, sliding = masks.get("full_attention"), masks.get("sliding_attention")
    if not (isinstance(full, torch.Tensor) and isinstance(sliding, torch.Tensor) and full.ndim == 4
            and full.shape[-1] == full.shape[-2]):
        return None
    if positions.ndim != 2 or find_packed_sequence_indices(positions) is None:
        return None  # one sample per row: transformers' own masks are right
    length = int(full.shape[-1])
    index = torch.arange(length, device=full.device)
    inside = (index[:, None] - index[None, :]) < window  # query minus key, as transformers' window overlay
    if full.dtype == torch.bool:
        fixed = full & inside
    else:  # an additive float mask (eager)
        fixed = full.masked_fill(~inside, torch.finfo(full.dtype).min)
    return args, {**kwargs, "attention_mask": {**masks, "sliding_attention": fixed}}


ANSWER_STOPS = ("template", "eos")


@dataclass
class AutoSettings(FamilySettings):
    """``model.auto``: the checkpoint's processor and template decide everything but this."""

    builds_random_model: ClassVar[bool] = False

    answer_stop: str = "template"
    """How an answer ends in training. ``template``: as the chat template renders it (its own end
    of turn, or the stop token it renders right after the answer). ``eos``: where the template
    renders no generation stop token in or right after an answer (llava-hf's LLaVA-1.5 and
    LLaVA-NeXT templates end an answer with a space), the tokenizer's EOS is appended to every
    answer and labelled, as the original LLaVA training appended ``</s>``; the model then learns
    to stop, and prompts built by mmtune carry it after earlier answers too. A template that has
    its stop token is unchanged by ``eos``."""

    def problems(self, prefix: str) -> list[str]:
        if self.answer_stop not in ANSWER_STOPS:
            return [f"{prefix}.answer_stop={self.answer_stop!r}: use one of {list(ANSWER_STOPS)}"]
        return []


@register_adapter
class AutoAdapter(ModelAdapter):
    """Processor-driven adapter for transformers image-text-to-text checkpoints."""

    family = "auto"
    settings_class = AutoSettings
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
        check_model_folder(config.path, config.image_limits)  # its files' sizes and depths, before any is parsed
        self._check_remote_code()
        self.processor = AutoProcessor.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
        self.tokenizer = getattr(self.processor, "tokenizer", None)
        problems = []
        if self.tokenizer is None:
            problems.append("its processor has no tokenizer")
        template = getattr(self.processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("default")
        if not template:
            problems.append("it has no chat template (save one with the processor: processor.chat_template = ...; "
                            "processor.save_pretrained(path))")
        image_token = getattr(self.processor, "image_token", None)
        if image_token is None:
            problems.append("its processor has no `image_token` attribute (the placeholder the template renders)")
        if problems:
            raise UnsupportedProcessorError(
                f"model.path={config.path!r} cannot be used with model.family=auto: " + "; ".join(problems)
            )
        check_chat_template(template, config.path, self.tokenizer.special_tokens_map)  # renders, bounded
        self.chat_template = template
        self.image_token = image_token
        self._placeholder_id = int(self.tokenizer.convert_tokens_to_ids(image_token))
        self.model_config = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
        # the token whose embeddings the model replaces with image features (Gemma 3: <image_soft_token>,
        # not the <start_of_image> placeholder its template renders)
        feature_id = getattr(self.model_config, "image_token_id", None)
        if feature_id is None:
            feature_id = getattr(self.model_config, "image_token_index", None)
        self.image_token_id = int(feature_id if feature_id is not None else self._placeholder_id)
        # generation stops at the tokenizer's EOS, the config's and the generation config's
        # eos_token_id (GLM-4.1V's holds <|user|>, Gemma 3's <end_of_turn>)
        eos = [self.tokenizer.eos_token_id]
        for value in (getattr(self.model_config, "eos_token_id", None), self._generation_eos()):
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and token not in eos:
                    eos.append(token)
        self.stop_token_ids = [int(i) for i in eos if i is not None]
        self._joins = self._probe_joins()
        self.image_input_names = tuple(self._joins)
        self._rope = self._rope_index()
        self.position_id_rows = 3 if self._rope is not None else 1
        if config.settings.answer_stop == "eos" and self.tokenizer.eos_token_id is None:
            raise ValueError(f"model.auto.answer_stop=eos: the tokenizer of model.path={config.path} has no EOS token "
                             "to append; set its eos_token, or model.auto.answer_stop=template")
        if self._template_answer_end[0] == "none" and config.settings.answer_stop == "template":
            log.warning(
                "model.path=%s: its chat template renders no stop token (%s) in or right after an assistant "
                "answer, so a model trained on it as rendered does not learn to end its answers; set "
                "model.auto.answer_stop=eos to append %r to every answer, labelled", config.path,
                self.tokenizer.convert_ids_to_tokens(self.stop_token_ids), self.tokenizer.eos_token)

    def _generation_eos(self) -> Any:
        """``eos_token_id`` of the checkpoint's ``generation_config.json`` (``None`` without one)."""
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.config.path).eos_token_id
        except OSError:
            return None

    # -- start-up checks ------------------------------------------------------------------------
    def _check_remote_code(self) -> None:
        """Refuse a checkpoint whose config, processor or model class is code shipped with it."""
        if self.config.trust_remote_code:
            return
        from transformers import PretrainedConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        try:
            values, _ = PretrainedConfig.get_config_dict(self.config.path)
        except (OSError, ValueError):
            return  # transformers names the problem itself when it loads the config
        found = dict(values.get("auto_map") or {})
        for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
            file = os.path.join(str(self.config.path), name)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as handle:
                    found.update(json.load(handle).get("auto_map") or {})
        model_type = values.get("model_type")
        if found or model_type not in CONFIG_MAPPING:
            what = f"auto_map {found}" if found else f"model_type {model_type!r}, which transformers does not know"
            raise RemoteCodeError(
                f"model.path={self.config.path!r} needs code shipped with the checkpoint ({what}); set "
                "model.trust_remote_code=true only if you trust the checkpoint's source"
            )

    def _call(self, images: list, count: int | None = None) -> dict[str, Any]:
        """The processor on ``images`` with a text holding one placeholder per image."""
        text = self.image_token * (len(images) if count is None else count)
        return self.processor(text=[text], images=images, return_text_replacement_offsets=True, return_tensors="pt")

    def _probe_joins(self) -> dict[str, InputJoin]:
        """Per image input, the join that makes two images' one-by-one outputs the joint output."""
        import torch

        first, second = _noise_image(50, 30, 1), _noise_image(24, 70, 2)
        try:
            joint = self._call([first, second])
            alone = [self._call([first]), self._call([second])]
        except Exception as err:  # noqa: BLE001 - any failure of the processor is named
            raise UnsupportedProcessorError(
                f"the processor of {self.config.path!r} fails on two small images: {type(err).__name__}: {err}"
            ) from err
        problems = []
        replaced = [r["replacement"] for r in joint["text_replacement_offsets"][0]]
        one_by_one = [a["text_replacement_offsets"][0][0]["replacement"] for a in alone]
        if replaced != one_by_one:
            problems.append("the text that replaces an image depends on the other images of the call")
        self._token_marks = {}
        ids = joint["input_ids"]
        for name in ("token_type_ids", "mm_token_type_ids"):  # text-aligned inputs the processor returns
            if name in joint:
                marked = ids[joint[name] == 1].unique()
                if not torch.equal(joint[name], torch.isin(ids, marked).to(joint[name].dtype)):
                    problems.append(f"its {name!r} is not 1 exactly on a set of token ids")
                self._token_marks[name] = marked.tolist()
        joins: dict[str, InputJoin] = {}
        for name in [k for k in joint if k not in _TEXT_KEYS]:
            value = joint[name]
            parts = [a.get(name) for a in alone]
            if not isinstance(value, torch.Tensor) or not all(isinstance(p, torch.Tensor) for p in parts):
                problems.append(f"its image input {name!r} is not a tensor ({type(value).__name__})")
                continue
            candidates = [InputJoin(axis=a) for a in range(value.ndim)] + [InputJoin(axis=0, stack=True)]
            for candidate in candidates:
                try:
                    joined = candidate.join(parts)
                except (RuntimeError, ValueError):
                    continue
                if joined.shape == value.shape and joined.dtype == value.dtype and torch.equal(joined, value):
                    joins[name] = candidate
                    break
            else:
                problems.append(
                    f"its image input {name!r} of two images ({tuple(value.shape)}) is no concatenation or stack of "
                    f"the one-image values ({[tuple(p.shape) for p in parts]})"
                )
        if problems:
            raise UnsupportedProcessorError(
                f"the processor of {self.config.path!r} ({type(self.processor).__name__}) cannot be used with "
                "model.family=auto: " + "; ".join(problems)
            )
        return joins

    def _rope_index(self):
        """transformers' own ``get_rope_index`` of the model class, for M-RoPE models; else None."""
        from transformers import MODEL_MAPPING

        try:
            model_class = MODEL_MAPPING[type(self.model_config)]
        except KeyError:
            return None
        if not hasattr(model_class, "get_rope_index"):
            return None
        from mmtune.models.qwen2_vl.positions import RopeIndex

        vision = getattr(self.model_config, "vision_config", None)
        return RopeIndex(self.model_config, model_class, self.image_token_id,
                         int(getattr(vision, "spatial_merge_size", 1)))

    # -- rendering -------------------------------------------------------------------------------
    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        # what processor.apply_chat_template(tokenize=False) renders, without its per-call set-up
        # (the length pass renders every prefix of every dialogue)
        from transformers.utils.chat_template_utils import render_jinja_template

        prompts, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                           add_generation_prompt=add_generation_prompt,
                                           **self.tokenizer.special_tokens_map)
        return prompts[0]

    @staticmethod
    def _message(role: str, segments: Sequence[Any]) -> dict:
        content = [
            {"type": "image"} if isinstance(s, Image) else {"type": "text", "text": s} for s in segments if s != ""
        ]
        # a message with nothing (an empty answer) keeps one empty text item: templates index the
        # first item (Idefics3's), and an empty text renders as nothing
        return {"role": role, "content": content or [{"type": "text", "text": ""}]}

    def _extends(self, dialogue_id: str, turn: int, before: str, after: str, what: str) -> None:
        if not after.startswith(before):
            k = _common_prefix(before, after)
            raise TemplateNotPrefixStableError(
                f"dialogue {dialogue_id!r}, turn {turn}: the chat template of {self.config.path!r} is not "
                f"prefix-stable: adding {what} changes character {k} ({before[max(0, k - 20):k + 20]!r} -> "
                f"{after[max(0, k - 20):k + 20]!r}). Labels cannot be derived from it; use a template that renders "
                "earlier turns identically, or a family adapter."
            )

    def _add_special_tokens(self, text: str) -> bool:
        # as the processor's own apply_chat_template: no second BOS when the template renders one
        bos = self.tokenizer.bos_token
        return not (bos is not None and text.startswith(bos))

    def _tokenize(self, text: str) -> tuple[list[int], "np.ndarray"]:
        """The ids and ``[n, 2]`` character offsets of ``text`` as the processor tokenizes it.

        The Rust tokenizer is called directly where the transformers call would leave its state
        as it is (no truncation, no padding, special tokens split as configured), so the ids
        and offsets are the ones that call returns, without building a BatchEncoding."""
        add = self._add_special_tokens(text)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if (backend is not None and backend.truncation is None and backend.padding is None
                and backend.encode_special_tokens == bool(getattr(self.tokenizer, "split_special_tokens", False))):
            encoding = backend.encode_batch([text], add_special_tokens=add)[0]
            return encoding.ids, _offsets(encoding.offsets)
        encoding = self.tokenizer(text, add_special_tokens=add, return_offsets_mapping=True)
        return encoding["input_ids"], _offsets(encoding["offset_mapping"])

    @functools.lru_cache(maxsize=65536)
    def _replacement_ids(self, replacement: str) -> tuple[str, tuple[int, ...], str] | None:
        """``(lead, core ids, trail)``: the replacement's text before its first and after its last
        special token, and the tokens of the part between (inclusive), which are its tokens in any
        text since the tokenizer splits at special tokens; ``None`` without a special token."""
        special = sorted((t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special),
                         key=len, reverse=True)
        found = [(replacement.find(t), t) for t in special if t in replacement]
        if not found:
            return None
        first = min(at for at, _ in found)
        last = max(replacement.rfind(t) + len(t) for _, t in found)
        core = replacement[first:last]
        ids = tuple(self.tokenizer(core, add_special_tokens=False)["input_ids"])
        return replacement[:first], ids, replacement[last:]

    @functools.cached_property
    def _placeholder_splits(self) -> bool:
        """The placeholder is one added special token: text around it tokenizes on its own."""
        special = {t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special}
        return self.image_token in special

    @functools.lru_cache(maxsize=65536)
    def _size(self, path: str) -> tuple[int, int]:
        from mmtune.models.qwen2_vl.images import oriented_size

        self.config.image_limits.check_file(path)
        return oriented_size(path)  # header only

    @functools.lru_cache(maxsize=65536)
    def _replacement(self, height: int, width: int) -> str:
        """The text the processor puts in place of an image of this size."""
        from PIL import Image as PILImage

        out = self._call([PILImage.new("RGB", (width, height), (127, 127, 127))])
        return out["text_replacement_offsets"][0][0]["replacement"]

    def _image_text(self, image: Image, dialogue_id: str | None = None, turn: int | None = None,
                    system_first: bool = False) -> str:
        try:
            width, height = self._size(image.path)
        except CorruptImageError:
            raise
        except Exception as err:  # noqa: BLE001 - PIL raises many types
            raise CorruptImageError(image.path, dialogue_id, turn, err, system_first) from err
        try:
            return self._replacement(height, width)
        except Exception as err:  # noqa: BLE001 - the processor's refusal, named with the image
            raise UnsupportedImageError(image.path, dialogue_id, turn, f"{type(err).__name__}: {err}",
                                        system_first) from err

    def _spans(self, dialogue: "Dialogue", system_prompt: str | None, train_on: str,
               add_generation_prompt: bool) -> tuple[str, list[_Span], int]:
        """The rendered text, its spans (turn parts in order) and the index of the first turn.

        Each turn's part is what rendering it adds to the render of the turns before it. That is
        computed on a window (the system message and the one or two turns before the turn, so
        that roles keep their parity) where the template renders turns locally (checked once per
        checkpoint on probe dialogues, :attr:`_windows_match`), and the joined parts are checked
        against the render of the whole dialogue; otherwise, or on any difference, every prefix
        of the dialogue is rendered (quadratic in the turns, same result)."""
        if train_on not in ("all_assistant", "last_assistant"):
            raise ValueError(f"train_on={train_on!r}; use 'all_assistant' or 'last_assistant'")
        turns = list(dialogue.turns)
        messages: list[dict] = []
        if turns and turns[0].role == "system":
            messages.append(self._message("system", turns[0].segments))
            turns = turns[1:]
        elif system_prompt:
            messages.append(self._message("system", (system_prompt,)))
        offset = 1 if dialogue.turns and dialogue.turns[0].role == "system" else 0
        head = len(messages)
        messages += [self._message(t.role, t.segments) for t in turns]
        roles = [t.role for t in turns]
        trainable = self._trainable(roles, train_on)
        found = None
        if self._windows_match:
            found = self._spans_by_window(messages, head, roles, trainable, add_generation_prompt)
        if found is None:
            found = self._spans_by_prefix(dialogue.id, messages, head, roles, trainable, offset,
                                          add_generation_prompt)
        return found[0], found[1], offset

    @staticmethod
    def _trainable(roles: list[str], train_on: str) -> list[bool]:
        last_assistant = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
        return [role == "assistant" and (train_on == "all_assistant" or i == last_assistant)
                for i, role in enumerate(roles)]

    def _spans_by_prefix(self, dialogue_id: str, messages: list[dict], head: int, roles: list[str],
                         trainable: list[bool], offset: int,
                         add_generation_prompt: bool) -> tuple[str, list[_Span]]:
        """Spans from the render of every prefix of the dialogue (the definition)."""
        spans: list[_Span] = []
        text = ""
        for index, role in enumerate(roles):
            where = index + offset
            if role not in ("user", "assistant"):
                raise ValueError(f"dialogue {dialogue_id!r}, turn {where}: role {role!r} is not allowed here")
            full = self._render(messages[: head + index + 1], add_generation_prompt=False)
            self._extends(dialogue_id, where, text, full, f"turn {where}")
            if role == "assistant":
                header = self._render(messages[: head + index], add_generation_prompt=True)
                self._extends(dialogue_id, where, text, header, "the generation prompt")
                body = _common_prefix(header, full, len(text))
                spans += [_Span(len(text), body, index), _Span(body, len(full), index, trainable[index])]
            else:
                spans.append(_Span(len(text), len(full), index))
            text = full
        if add_generation_prompt:
            if not roles or roles[-1] != "user":
                raise ValueError(
                    f"dialogue {dialogue_id!r}: add_generation_prompt needs the dialogue to end with a user turn"
                )
            prompt = self._render(messages, add_generation_prompt=True)
            self._extends(dialogue_id, offset + len(roles), text, prompt, "the generation prompt")
            spans.append(_Span(len(text), len(prompt), -1))
            text = prompt
        return text, spans

    def _spans_by_window(self, messages: list[dict], head: int, roles: list[str], trainable: list[bool],
                         add_generation_prompt: bool) -> tuple[str, list[_Span]] | None:
        """The spans of :meth:`_spans_by_prefix` from renders of a bounded number of turns each,
        or ``None`` where they cannot be shown equal (then the caller renders every prefix, which
        also raises the errors of a bad dialogue as the definition does)."""
        if any(role not in ("user", "assistant") for role in roles):
            return None
        if add_generation_prompt and (not roles or roles[-1] != "user"):
            return None
        renders: dict[tuple[int, int, bool], str] = {}

        def render(lo: int, hi: int, generation: bool) -> str:  # system message + turns[lo:hi]
            key = (lo, hi, generation)
            if key not in renders:
                renders[key] = self._render(messages[:head] + messages[head + lo:head + hi], generation)
            return renders[key]

        spans: list[_Span] = []
        pieces: list[str] = []
        length = 0
        try:
            for index, role in enumerate(roles):
                # windows of _WINDOW turns (even: the template sees the roles at their parity); the
                # render before a turn is then the one that ended the turn before it
                lo = (index - 1) // self._WINDOW * self._WINDOW if index else 0
                base = render(lo, index, False) if index else ""
                full = render(lo, index + 1, False)
                if not full.startswith(base):
                    return None
                shift = length - len(base)
                if role == "assistant":
                    header = render(lo, index, True)
                    if not header.startswith(base):
                        return None
                    body = _common_prefix(header, full, len(base)) + shift
                    spans += [_Span(length, body, index), _Span(body, len(full) + shift, index, trainable[index])]
                else:
                    spans.append(_Span(length, len(full) + shift, index))
                pieces.append(full[len(base):])
                length += len(full) - len(base)
            text = "".join(pieces)
            if text != render(0, len(roles), False):
                return None
            if add_generation_prompt:
                prompt = render(0, len(roles), True)
                if not prompt.startswith(text):
                    return None
                spans.append(_Span(len(text), len(prompt), -1))
                text = prompt
        except Exception:  # noqa: BLE001 - the template refused a window: the definition decides
            return None
        return text, spans

    #: turns per rendering window (even); a turn is rendered after at least one and at most this many
    _WINDOW: ClassVar[int] = 4

    @functools.cached_property
    def _windows_match(self) -> bool:
        """Whether windowed rendering gives the per-prefix spans on probe dialogues (with and
        without a system message, images in several turns, a generation prompt)."""
        image = Image("probe.png")
        user = [("Look at ", image, " and describe it."), ("Second question?",), (image, image, "Compare."),
                ("More text  with   spaces\n",), ("Last one: ", image)]
        answer = ["An answer.", " Another one.\n", "Third.", "Fourth answer here."]
        probes = []
        for system in (None, "Be brief."):
            messages = [self._message("system", (system,))] if system else []
            roles = []
            for k, segments in enumerate(user):
                messages.append(self._message("user", segments))
                roles.append("user")
                if k < len(answer):
                    messages.append(self._message("assistant", (answer[k],)))
                    roles.append("assistant")
            head = len(messages) - len(roles)
            probes += [(messages, head, roles, False), (messages, head, roles, True),
                       (messages[:-1], head, roles[:-1], False)]
        for messages, head, roles, generation in probes:
            trainable = self._trainable(roles, "all_assistant")
            windowed = self._spans_by_window(messages, head, roles, trainable, generation)
            try:
                defined = self._spans_by_prefix("probe", messages, head, roles, trainable, 0, generation)
            except TemplateNotPrefixStableError:
                return False
            except Exception:  # noqa: BLE001 - the template's own refusal of the probe
                defined = None
            if windowed != defined:
                return False
        return True

    def _expand(self, dialogue: "Dialogue", text: str, spans: list[_Span], offset: int) -> tuple[str, list[_Span]]:
        """``text`` with every image placeholder replaced by the processor's text for that image,
        and the spans moved to match, each image a span of its own."""
        images = [(t, image) for t, turn in enumerate(dialogue.turns) for image in turn.images]
        pieces: list[str] = []
        out: list[_Span] = []
        found = 0
        length = 0  # of the expanded text so far
        for span in spans:
            cursor = span.start
            while (at := text.find(self.image_token, cursor, span.end)) >= 0:
                if found >= len(images):
                    raise UnsupportedProcessorError(
                        f"dialogue {dialogue.id!r}: the chat template renders more image placeholders "
                        f"({self.image_token!r}) than the dialogue's {len(images)} images"
                    )
                turn_index, image = images[found]
                if span.turn + offset != turn_index:
                    raise UnsupportedProcessorError(
                        f"dialogue {dialogue.id!r}: the chat template renders image {found} (of turn {turn_index}) "
                        f"outside its turn; it must render each image in its own turn"
                    )
                replacement = self._image_text(image, dialogue.id, turn_index, offset == 1)
                out.append(_Span(length, length + at - cursor, span.turn, span.trainable))
                pieces.append(text[cursor:at])
                length += at - cursor
                out.append(_Span(length, length + len(replacement), span.turn, image=image))
                pieces.append(replacement)
                length += len(replacement)
                cursor = at + len(self.image_token)
                found += 1
            out.append(_Span(length, length + span.end - cursor, span.turn, span.trainable))
            pieces.append(text[cursor:span.end])
            length += span.end - cursor
        if found != len(images):
            raise UnsupportedProcessorError(
                f"dialogue {dialogue.id!r}: the chat template rendered {found} image placeholders "
                f"({self.image_token!r}) for {len(images)} images; it must render one per image"
            )
        return "".join(pieces), out

    def _tokens(self, dialogue: "Dialogue", text: str, spans: list[_Span], offset: int) -> _Tokens:
        """The tokens of the expanded text with their character offsets (a spliced image's core
        stands as one token at its first character), and the spans they fall in.

        Where the placeholder is a special token and every image's text holds one, each image's
        text from its first to its last special token (its core) is tokenized once per distinct
        text and spliced in for a placeholder in the text tokenized around it (Gemma 3's
        ``\\n\\n`` before and after the core stay in that text): the same ids as tokenizing the whole
        expanded text, since the tokenizer splits at special tokens. Otherwise the expanded text
        is tokenized as a whole."""
        import numpy as np

        expanded, moved = self._expand(dialogue, text, spans, offset)
        images = [s for s in moved if s.image is not None]
        pieces = [self._replacement_ids(expanded[s.start:s.end]) for s in images]
        if not self._placeholder_splits or any(p is None for p in pieces):
            ids, offsets = self._tokenize(expanded)
            return _Tokens(ids, offsets[:, 0], offsets[:, 1], {}, moved)
        # the expanded text with each image's core (special token to special token) as one placeholder
        parts, markers, cursor, short = [], [], 0, 0  # markers: (position in the short text, image)
        for k, (span, (lead, _, trail)) in enumerate(zip(images, pieces)):
            parts += [expanded[cursor:span.start], lead]
            short += span.start - cursor + len(lead)
            markers.append((short, span.start + len(lead), span.end - len(trail)))
            parts += [self.image_token, trail]
            short += len(self.image_token) + len(trail)
            cursor = span.end
        parts.append(expanded[cursor:])
        text_short = "".join(parts)
        ids, offsets = self._tokenize(text_short)
        starts, ends = offsets[:, 0].copy(), offsets[:, 1].copy()
        # the placeholders that stand for the images, in order; every later token moves by the
        # length its image's core has beyond the placeholder
        cores: dict[int, tuple[int, ...]] = {}
        moves = np.zeros(len(ids), dtype=np.int64)
        k = 0
        position = -1
        while k < len(images):
            try:
                position = ids.index(self._placeholder_id, position + 1)
            except ValueError:
                break
            if starts[position] == markers[k][0]:
                cores[position] = pieces[k][1]
                moves[position] = (markers[k][2] - markers[k][1]) - len(self.image_token)
                starts[position], ends[position] = markers[k][1], markers[k][1] + 1
                k += 1
        if k != len(images):  # pragma: no cover - the placeholder is one special token, so never
            raise UnsupportedProcessorError(f"dialogue {dialogue.id!r}: image placeholders were not tokenized alone")
        shift = np.cumsum(moves) - moves
        text_token = ends > starts
        text_token[list(cores)] = False
        starts[text_token] += shift[text_token]
        ends[text_token] += shift[text_token]
        return _Tokens(ids, starts, ends, cores, moved)

    def _encode(self, dialogue: "Dialogue", system_prompt: str | None, train_on: str,
                add_generation_prompt: bool) -> EncodedDialogue:
        import numpy as np

        text, spans, offset = self._spans(dialogue, system_prompt, train_on, add_generation_prompt)
        tokens = self._tokens(dialogue, text, spans, offset)
        spans = tokens.spans
        # each token goes to the first span that ends after its first character, never to an
        # earlier span than the token before it (added special tokens, offsets (0, 0): that one's)
        ids, starts = tokens.ids, tokens.starts
        added = (starts == 0) & (tokens.ends == 0)
        ends = np.fromiter((s.end for s in spans), dtype=np.int64, count=len(spans))
        where = np.minimum(np.searchsorted(ends, starts, side="right"), len(spans) - 1)
        where[added] = 0
        where = np.maximum.accumulate(where) if len(where) else where
        # a chunk ends before an added special token and where the next token starts past its span
        last = np.ones(len(ids), dtype=bool)
        last[:-1] = added[1:] | (ends[where[:-1]] <= starts[1:])
        chunks_of: dict[int, list] = {}
        first = 0
        cores = sorted(tokens.cores)
        for stop in (np.flatnonzero(last) + 1).tolist():
            span = spans[where[stop - 1]]
            if cores and bisect.bisect_left(cores, first) < bisect.bisect_left(cores, stop):
                joined: list[int] = []
                for position in range(first, stop):
                    joined.extend(tokens.cores.get(position, (ids[position],)))
                piece = tuple(joined)
            else:
                piece = tuple(ids[first:stop])
            chunk = (ImageChunk(span.image, len(piece), piece) if span.image is not None
                     else TokenChunk(piece, span.trainable))
            chunks_of.setdefault(span.turn, []).append(chunk)
            first = stop
        roles = [t.role for t in dialogue.turns[offset:]]
        turns = [EncodedTurn(role, chunks_of.get(index, [])) for index, role in enumerate(roles)]
        if self._answer_stop is not None:
            self._label_answer_stops(turns)
        return EncodedDialogue(dialogue.id, [], turns, chunks_of.get(-1, []))

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

    # -- contract ---------------------------------------------------------------------------------
    def encode_dialogue(
        self,
        dialogue: "Dialogue",
        *,
        system_prompt: str | None = None,
        train_on: str = "all_assistant",
        add_generation_prompt: bool = False,
    ) -> EncodedDialogue:
        """Render with the checkpoint's chat template and expand images as its processor does.
        ``system_prompt`` adds a system message when the dialogue has none (``None``/``""``: the
        template's own default)."""
        return self._encode(dialogue, system_prompt, train_on, add_generation_prompt)

    def image_token_count(self, image: Image) -> int:
        """Tokens of the processor's text for the image (its size read from the file header)."""
        return self._count(self._image_text(image))

    @functools.lru_cache(maxsize=65536)
    def _count(self, replacement: str) -> int:
        return len(self.tokenizer(replacement, add_special_tokens=False)["input_ids"])

    @classmethod
    def planned_image_tokens(cls, config: ModelConfig, model_config: Any) -> int | None:
        """``None``: counts depend on each image's size (``mmtune plan`` asks the class, before any
        adapter is built, and then uses ``data.mixture.tokens_per_image``)."""
        return None

    def fingerprint(self) -> str:
        state = {
            "family": self.family,
            "path": self.config.path,
            "template": hashlib.sha1(self.chat_template.encode()).hexdigest(),
            "answer_stop": self.config.settings.answer_stop,
            "vocab": len(self.tokenizer),
            "processor": self.processor.to_dict() if hasattr(self.processor, "to_dict") else repr(self.processor),
        }
        return state_fingerprint(state)

    # -- the batch: image inputs -----------------------------------------------------------------
    def image_input_joins(self) -> dict[str, InputJoin]:
        """The join of each image input, found at start-up from the processor itself."""
        return dict(self._joins)

    def _decode(self, path: str):
        from transformers.image_utils import load_image

        self.config.image_limits.check_file(path)  # from the header, before the decode
        return load_image(path)

    def load_image(self, path: str) -> dict[str, "np.ndarray"]:
        """The processor's image inputs of this one image (what the pixel cache stores)."""
        try:
            out = self._call([self._decode(path)])
        except CorruptImageError:
            raise
        except (OSError, SyntaxError) as err:  # not an image PIL can read
            raise CorruptImageError(path, None, None, err) from err
        except Exception as err:  # noqa: BLE001 - the processor's refusal, named with the file
            raise UnsupportedImageError(path, None, None, f"{type(err).__name__}: {err}") from err
        return {name: out[name].numpy() for name in self.image_input_names}

    def image_batch(self, images: Sequence[Any]) -> dict[str, "torch.Tensor"]:
        """Cached per-image inputs (dicts of arrays or tensors) joined as the processor joins them."""
        import torch

        parts = [{k: torch.as_tensor(v) for k, v in image.items()} for image in images]
        return self.join_image_inputs(parts)

    def image_inputs(self, paths: Sequence[str]) -> dict[str, "torch.Tensor"]:
        return self.image_batch([self.load_image(p) for p in paths])

    def pixel_settings(self) -> dict[str, Any]:
        """The processor's settings (image processor included): the pixel cache's key."""
        settings = self.processor.to_dict() if hasattr(self.processor, "to_dict") else repr(self.processor)
        return {"settings": {"class": type(self.processor).__name__, **settings} if isinstance(settings, dict)
                else settings, "uint8": False}

    def preprocess_images(self, paths: list[str]) -> "torch.Tensor":
        inputs = self.image_inputs(paths)
        if set(inputs) != {"pixel_values"} or inputs["pixel_values"].ndim != 4:
            raise NotImplementedError(
                f"the processor of {self.config.path!r} gives {sorted(inputs)}, not pixel_values [N, 3, H, W] "
                "alone: use adapter.image_inputs(paths)"
            )
        return inputs["pixel_values"]

    def token_inputs(self, input_ids: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """The processor's text-aligned inputs (Gemma 3's ``token_type_ids``: 1 on its image
        tokens), computed from ``input_ids`` as the processor marks them."""
        import torch

        return {name: torch.isin(input_ids, torch.tensor(marked, dtype=input_ids.dtype)).long()
                for name, marked in self._token_marks.items()}

    # -- the batch: position ids -----------------------------------------------------------------
    def position_ids(
        self, input_ids: "torch.Tensor", image_inputs: dict[str, "torch.Tensor"] | None = None
    ) -> "torch.Tensor":
        """One running position, or the model's own ``get_rope_index`` rows (M-RoPE models)."""
        if self._rope is None:
            return super().position_ids(input_ids, image_inputs)
        grid = None if image_inputs is None else image_inputs.get("image_grid_thw")
        return self._rope(input_ids, grid)

    def prompt_positions(self, input_ids: "torch.Tensor", image_paths: Sequence[str]) -> tuple["torch.Tensor", int]:
        if self._rope is None:
            return super().prompt_positions(input_ids, image_paths)
        inputs = self.image_inputs(image_paths) if image_paths else None
        grid = None if inputs is None else inputs.get("image_grid_thw")
        return self._rope.with_delta(input_ids, grid)

    def load_model(self, **kwargs: Any) -> "nn.Module":
        from transformers import AutoModelForImageTextToText

        dtype, attn = load_dtype_and_attention(kwargs, self.config)
        kwargs.pop("seed", None)
        model = AutoModelForImageTextToText.from_pretrained(
            self.config.path,
            dtype=dtype,
            attn_implementation=attn,
            trust_remote_code=self.config.trust_remote_code,
            **kwargs,
        )
        text = self.text_config(model.config)
        if getattr(text, "sliding_window", None) and "sliding_attention" in (getattr(text, "layer_types", None) or []):
            model.get_decoder().register_forward_pre_hook(
                functools.partial(_packed_window_masks, window=int(text.sliding_window)), with_kwargs=True)
        return model

    def module_groups(self, model: "nn.Module") -> ModuleGroups:
        """Found from the model's structure (:func:`~mmtune.models.base.find_module_groups`):
        transformers' vision encoder and decoder look-ups, the rest (and parameters outside any
        child module, LLaVA-OneVision's ``image_newline``) the projector."""
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

        out = self._call([PILImage.new("RGB", (64, 64), (0, 0, 0))])
        return {name: out[name] for name in self.image_input_names}

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

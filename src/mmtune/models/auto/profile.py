"""Stage 1: the checkpoint's processor and chat template, and what is probed from them once.

:func:`load_processor_and_template` is the one place the processor and its template are read from
a checkpoint folder (checks of a hostile folder slot in there). :class:`ProfileStage` probes,
once per adapter: the stop tokens, and per image input the join that makes two images'
one-by-one processor outputs equal the joint output (:class:`~mmtune.models.base.InputJoin`).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from mmtune.models.auto.errors import RemoteCodeError, UnsupportedProcessorError
from mmtune.models.auto.render import common_prefix
from mmtune.models.base import InputJoin
from mmtune.models.images import noise_image

__all__ = ["LoadedProcessor", "ProfileStage", "load_processor_and_template"]

#: processor outputs that are text inputs, not image inputs (PaliGemma's processor also returns
#: ``labels`` of its own, which the collator builds itself)
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids",
                        "text_replacement_offsets", "labels"})



@dataclass
class LoadedProcessor:
    """A checkpoint's processor, its tokenizer, chat template and image placeholder."""

    processor: Any
    tokenizer: Any
    chat_template: str
    image_token: str


def load_processor_and_template(path: str, trust_remote_code: bool) -> LoadedProcessor:
    """The processor of ``path`` with its tokenizer, chat template and image placeholder.

    Raises:
        UnsupportedProcessorError: no tokenizer, no chat template or no ``image_token`` (all named).
    """
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", None)
    problems = []
    if tokenizer is None:
        problems.append("its processor has no tokenizer")
    template = getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        problems.append("it has no chat template (save one with the processor: processor.chat_template = ...; "
                        "processor.save_pretrained(path))")
    image_token = getattr(processor, "image_token", None)
    if image_token is None:
        problems.append("its processor has no `image_token` attribute (the placeholder the template renders)")
    if problems:
        raise UnsupportedProcessorError(
            f"model.path={path!r} cannot be used with model.family=auto: " + "; ".join(problems)
        )
    return LoadedProcessor(processor, tokenizer, template, image_token)


def check_remote_code(path: str, trust_remote_code: bool) -> None:
    """Refuse a checkpoint whose config, processor or model class is code shipped with it."""
    if trust_remote_code:
        return
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        values, _ = PretrainedConfig.get_config_dict(path)
    except (OSError, ValueError):
        return  # transformers names the problem itself when it loads the config
    found = dict(values.get("auto_map") or {})
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        file = os.path.join(str(path), name)
        if os.path.isfile(file):
            with open(file, encoding="utf-8") as handle:
                found.update(json.load(handle).get("auto_map") or {})
    model_type = values.get("model_type")
    if found or model_type not in CONFIG_MAPPING:
        what = f"auto_map {found}" if found else f"model_type {model_type!r}, which transformers does not know"
        raise RemoteCodeError(
            f"model.path={path!r} needs code shipped with the checkpoint ({what}); set "
            "model.trust_remote_code=true only if you trust the checkpoint's source"
        )


class _TokenizerRecorder:
    """A processor's tokenizer that records the texts it is called on (everything else delegated)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.texts: list[str] = []

    def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.texts += [text] if isinstance(text, str) else [t for t in (text or []) if isinstance(t, str)]
        return self.tokenizer(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)


class ProfileStage:
    """Stop tokens and image-input joins of the processor (mixed into the adapter)."""

    #: ``(text before the index, index of the first image)`` where the processor numbers the images
    #: of a call in their text (MiniCPM-V's ``<image_id_start_token>0<image_id_end_token>...``)
    _index_rule: tuple[str, int] | None = None

    def _image_index_rule(self, replaced: list[str], one_by_one: list[str], image: Any) -> tuple[str, int] | None:
        """The rule by which the k-th image's text differs from its text alone: the same text with the
        decimal number after a fixed lead counting up from the first image's; checked on a call of
        twelve copies of ``image`` (numbers of two digits), whose text alone is ``one_by_one[0]``.
        ``None`` where the difference is no such number."""
        if len(replaced) != len(one_by_one):
            return None
        alone, second = one_by_one[1], replaced[1]
        lead = common_prefix(alone, second)
        digits = len(alone[lead:]) - len(alone[lead:].lstrip("0123456789"))
        if replaced[0] != one_by_one[0] or not digits or alone[lead - 1:lead].isdigit():
            return None
        base = int(alone[lead:lead + digits])
        rule = (alone[:lead], base)
        count = 12
        try:
            joint = self._replacements(self._call([image] * count), [image] * count)
            numbered = [self._numbered(one_by_one[0], k, rule) for k in range(count)]
        except Exception:  # noqa: BLE001 - the processor's refusal of the longer call, or no number: no rule
            return None
        return rule if numbered == joint else None

    @staticmethod
    def _numbered(text: str, index: int, rule: tuple[str, int]) -> str:
        """``text`` (an image's text alone) as the ``index``-th image of a call writes it."""
        lead, base = rule
        number = str(base)
        if not text.startswith(lead + number):
            raise UnsupportedProcessorError(f"an image's text {text[:80]!r} does not number it after {lead!r}")
        return lead + str(base + index) + text[len(lead) + len(number):]

    def _stop_tokens(self) -> list[int]:
        """The tokenizer's EOS, the config's and the generation config's ``eos_token_id``
        (GLM-4.1V's holds ``<|user|>``, Gemma 3's ``<end_of_turn>``): where generation stops."""
        eos = [self.tokenizer.eos_token_id]
        for value in (getattr(self.model_config, "eos_token_id", None), self._generation_eos()):
            for token in value if isinstance(value, (list, tuple)) else [value]:
                if token is not None and token not in eos:
                    eos.append(token)
        return [int(i) for i in eos if i is not None]

    def _generation_eos(self) -> Any:
        """``eos_token_id`` of the checkpoint's ``generation_config.json`` (``None`` without one)."""
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(self.config.path).eos_token_id
        except OSError:
            return None

    def _call(self, images: list, count: int | None = None) -> dict[str, Any]:
        """The processor on ``images`` with a text holding each image as the template renders it
        (:attr:`_image_item_text`: the bare placeholder, or with the wrappers a processor such as
        HunYuan-VL's requires around it)."""
        text = self._image_item_text * (len(images) if count is None else count)
        return self.processor(text=[text], images=images, return_text_replacement_offsets=True, return_tensors="pt")

    def _replacements(self, out: dict[str, Any], images: list) -> list[str]:
        """The text that replaces each image's placeholder in ``out``, a :meth:`_call` on ``images``:
        the processor's ``text_replacement_offsets``, or, where its own ``__call__`` does not give them
        (Idefics2's, Mllama's), read off the text it hands its tokenizer (:meth:`_replacements_seen`)."""
        if "text_replacement_offsets" in out:
            return [r["replacement"] for r in out["text_replacement_offsets"][0]]
        return self._replacements_seen(images)

    def _replacements_seen(self, images: list) -> list[str]:
        """Each image's text from the one text the processor tokenizes for :attr:`_image_item_text`
        per image: that text is the processor's prefix (:attr:`_text_change`), then per image the
        item's text around the placeholder with the image's text in its place, then its suffix. For
        several images each must be its text alone (else the list is the whole text, which the
        caller finds different from the one-by-one texts and names)."""
        recorder = _TokenizerRecorder(self.processor.tokenizer)
        self.processor.tokenizer = recorder
        try:
            self.processor(text=[self._image_item_text * len(images)], images=images, return_tensors="pt")
        finally:
            self.processor.tokenizer = recorder.tokenizer
        if len(recorder.texts) != 1:
            raise UnsupportedProcessorError(
                f"the processor of {self.config.path!r} ({type(self.processor).__name__}) returns no "
                f"text_replacement_offsets and tokenizes {len(recorder.texts)} texts for one, so the text it puts "
                "for an image cannot be read: use a family adapter")
        seen = recorder.texts[0]
        prefix, suffix = self._text_change
        lead, trail = self._image_item_text.split(self.image_token, 1)
        if len(images) > 1:
            alone = [self._replacements_seen([image])[0] for image in images]
            return alone if prefix + "".join(lead + r + trail for r in alone) + suffix == seen else [seen]
        head, tail = prefix + lead, trail + suffix
        if not (seen.startswith(head) and seen.endswith(tail) and len(seen) >= len(head) + len(tail)):
            raise UnsupportedProcessorError(
                f"the processor of {self.config.path!r} ({type(self.processor).__name__}) returns no "
                f"text_replacement_offsets, and the text it tokenizes for one image ({seen[:200]!r}) does not keep "
                f"{head!r} before and {tail!r} after the image: use a family adapter")
        return [seen[len(head):len(seen) - len(tail)]]

    @functools.cached_property
    def _image_item_renders(self) -> tuple[str, str]:
        """The template's rendering of a user message of one image item, and of one of an empty text."""
        return (self._render([{"role": "user", "content": [{"type": "image"}]}], add_generation_prompt=False),
                self._render([{"role": "user", "content": [{"type": "text", "text": ""}]}],
                             add_generation_prompt=False))

    def _template_placeholder(self, image_token: str) -> str:
        """The image placeholder the chat template renders: ``image_token`` where an image item's text
        holds it (every class but one tried), else the one added token that text holds (QianfanOCR
        renders ``<image>``, its ``image_placeholder_token``, and expands it into ``<IMG_CONTEXT>`` runs,
        its ``image_token``); ``image_token`` where neither is found (the start-up probes then name the
        problem)."""
        try:
            with_image, without = self._image_item_renders
        except Exception:  # noqa: BLE001 - a template that cannot render this is named by the probes
            return image_token
        if with_image.count(image_token) > without.count(image_token):
            return image_token
        added = [t for t in self.tokenizer.get_added_vocab() if t and with_image.count(t) > without.count(t)]
        # the longest of them: "<image>" also holds any added token that is a piece of it
        special = [t for t in added if not any(t != u and t in u for u in added)]
        return special[0] if len(special) == 1 else image_token

    @functools.cached_property
    def _image_item_text(self) -> str:
        """The placeholder alone where the processor accepts it (every class tested before HunYuan-VL);
        else what the chat template renders for one image item: a user message of one image against
        one of an empty text, less their common prefix and suffix."""
        try:
            self.processor(text=[self.image_token], images=[noise_image(50, 30, 1)], return_tensors="pt")
            return self.image_token
        except Exception:  # noqa: BLE001 - the processor's refusal: try the template's rendering
            pass
        with_image, without = self._image_item_renders
        head = common_prefix(with_image, without)
        tail = 0
        while tail < min(len(with_image), len(without)) - head and with_image[-1 - tail] == without[-1 - tail]:
            tail += 1
        item = with_image[head:len(with_image) - tail]
        return item if self.image_token in item else self.image_token

    @functools.cached_property
    def _text_change(self) -> tuple[str, str]:
        """``(prefix, suffix)``: the text the processor's own call adds around the text it is given
        (Janus saved with ``use_default_system_prompt=True``: its default system prompt; Molmo2:
        the BOS its templates lack), seen by handing it a marker text and recording what it passes
        its tokenizer. mmtune adds the same (:meth:`RenderStage._spans`)."""
        marker = "mmtune text probe"
        recorder = _TokenizerRecorder(self.processor.tokenizer)
        self.processor.tokenizer = recorder
        try:
            self.processor(text=[marker], return_tensors="pt")
        except Exception:  # noqa: BLE001 - a processor that needs images with text: no change known
            return "", ""
        finally:
            self.processor.tokenizer = recorder.tokenizer
        texts = [t for t in recorder.texts if marker in t]
        if not texts:
            return "", ""
        at = texts[0].index(marker)
        return texts[0][:at], texts[0][at + len(marker):]

    def _text_aligned_values(self, first: Any, second: Any, joint: dict[str, Any],
                             problems: list[str]) -> dict[str, dict[int, int]]:
        """Per text-aligned input (every integer output but the ids shaped as the ids: Gemma 3's
        ``token_type_ids``, ``mm_token_type_ids``, ERNIE-4.5-VL's ``moe_mm_token_type_ids``), the
        value the processor gives each token id (ids it gives 0 left out), read off its call on the
        template's rendering of a user message of two images, so that the tokens the template puts
        around an image are seen too (``joint``, the call on the placeholders alone, where the template
        renders no such message). An input that gives one id two values is a problem."""
        import torch

        message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}]
        try:
            text = self._render(message, add_generation_prompt=True)
            kwargs = {} if self._add_special_tokens(text) else {"add_special_tokens": False}
            out = self.processor(text=[text], images=[first, second], return_tensors="pt", **kwargs)
        except Exception:  # noqa: BLE001 - a template that renders no lone user message: the placeholders' call
            out = joint
        ids = out["input_ids"]
        tables = {}
        for name, values in out.items():
            if (name in ("input_ids", "attention_mask", "labels") or not isinstance(values, torch.Tensor)
                    or values.shape != ids.shape or values.is_floating_point()):
                continue
            table = {}
            for token in ids.unique().tolist():
                seen = values[ids == token].unique().tolist()
                if len(seen) != 1:
                    problems.append(f"its {name!r} gives token id {token} the values {seen}, not one value per id")
                    break
                if seen[0]:
                    table[token] = int(seen[0])
            tables[name] = table
        return tables

    def _probe_joins(self) -> dict[str, InputJoin]:
        """Per image input, the join that makes two images' one-by-one outputs the joint output."""
        import torch

        first, second = noise_image(50, 30, 1), noise_image(24, 70, 2)
        try:
            joint = self._call([first, second])
            alone = [self._call([first]), self._call([second])]
        except Exception as err:  # noqa: BLE001 - any failure of the processor is named
            raise UnsupportedProcessorError(
                f"the processor of {self.config.path!r} fails on two small images (50 x 30 and 24 x 70 px, each as {self._image_item_text!r} in the text): "
                f"{type(err).__name__}: {err}"
            ) from err
        problems = []
        replaced = self._replacements(joint, [first, second])
        one_by_one = [self._replacements(a, [image])[0] for a, image in zip(alone, (first, second))]
        if replaced != one_by_one:
            self._index_rule = self._image_index_rule(replaced, one_by_one, first)
            if self._index_rule is None:
                problems.append("the text that replaces an image depends on the other images of the call")
        self._token_marks = self._text_aligned_values(first, second, joint, problems)
        joins: dict[str, InputJoin] = {}
        self._input_dtypes, self._empty_parts = {}, {}
        for name in [k for k in joint if k not in _TEXT_KEYS and k not in self._token_marks]:
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
                    self._input_dtypes[name] = value.dtype
                    if not candidate.stack:  # an image without rows of it (Step3p7's local crops) adds none
                        self._empty_parts[name] = (value.shape[:candidate.axis] + (0,)
                                                   + value.shape[candidate.axis + 1:], value.dtype)
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

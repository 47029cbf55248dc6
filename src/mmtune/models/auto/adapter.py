"""The ``auto`` family's adapter: the contract of :mod:`mmtune.models.base` over the stages of
this package (see its doc); settings ``model.auto``."""

from __future__ import annotations

import bisect
import hashlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from mmtune.models._utils import state_fingerprint
from mmtune.models.auto.authority import ProcessorCallAuthority
from mmtune.models.auto.batch import BatchStage
from mmtune.models.auto.errors import UnsupportedProcessorError
from mmtune.models.auto.image_text import ImageTextStage
from mmtune.models.auto.profile import (
    ProfileStage,
    check_remote_code,
    load_processor_and_template,
)
from mmtune.models.auto.render import RenderStage
from mmtune.models.auto.stops import AnswerStopStage
from mmtune.models.base import EncodedDialogue, EncodedTurn, ImageChunk, TokenChunk
from mmtune.models.checkpoint_guard import check_chat_template, check_model_folder
from mmtune.models.config import FamilySettings, ModelConfig
from mmtune.models.encoder import Encoder
from mmtune.models.registry import register_adapter

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.core.dialogue import Dialogue

__all__ = ["AutoAdapter", "AutoSettings"]

log = logging.getLogger(__name__)

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
class AutoAdapter(ProfileStage, RenderStage, ImageTextStage, AnswerStopStage, BatchStage, ProcessorCallAuthority,
                  Encoder):
    """The one encoder with every stage from the checkpoint's processor (see the package doc)."""

    family = "auto"
    settings_class = AutoSettings
    default_lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_exclude_modules = r".*(vision_tower|visual|vision_model|multi_modal_projector|connector|merger).*"

    def _load_profile(self) -> None:
        """The processor (with its tokenizer, chat template and image placeholder) and the model
        config, read from ``model.path`` after the folder's checks (sizes and depths, remote code, a
        bounded render of its template); the image and stop tokens from them."""
        from transformers import AutoConfig

        config = self.config
        if config.path is None:
            raise ValueError(
                "model.family=auto needs model.path: a checkpoint directory (or hub id) with a processor and a "
                "chat template; for a random-weight tiny model use model.family=llava with model.path=null"
            )
        check_model_folder(config.path, config.image_limits)  # its files' sizes and depths, before any is parsed
        check_remote_code(config.path, config.trust_remote_code)
        loaded = load_processor_and_template(config.path, config.trust_remote_code)
        check_chat_template(loaded.chat_template, config.path, loaded.tokenizer.special_tokens_map)  # renders, bounded
        self.model_config = AutoConfig.from_pretrained(config.path, trust_remote_code=config.trust_remote_code)
        self.processor, self.tokenizer = loaded.processor, loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.image_token = self._template_placeholder(loaded.image_token)
        self._placeholder_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
        # the token whose embeddings the model replaces with image features (Gemma 3: <image_soft_token>,
        # not the <start_of_image> placeholder its template renders)
        feature_id = getattr(self.model_config, "image_token_id", None)
        if feature_id is None:
            feature_id = getattr(self.model_config, "image_token_index", None)
        self.image_token_id = int(feature_id if feature_id is not None else self._placeholder_id)
        self.stop_token_ids = self._stop_tokens()

    def _setup_images(self) -> None:
        """The join of each image input (and the processor's token marks), probed on two images."""
        self._joins = self._probe_joins()
        self.image_input_names = tuple(self._joins)
        self._check_model_takes_images()

    def _check_model_takes_images(self) -> None:
        """Refuse a model class whose ``forward`` does not name every image input the processor makes:
        a text model listed as image-text-to-text (Mistral 4's ``Mistral4ForCausalLM``) would drop the
        images without a word."""
        import inspect

        from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        model_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(self.model_config), None)
        if model_class is None:
            return  # AutoModelForImageTextToText names the problem when it loads
        taken = inspect.signature(model_class.forward).parameters
        missing = [name for name in self.image_input_names if name not in taken]
        if missing:
            raise UnsupportedProcessorError(
                f"model.path={self.config.path!r}: {model_class.__name__}.forward takes no {missing}, image inputs its "
                f"processor ({type(self.processor).__name__}) makes, so the images would never reach the model; "
                "use a checkpoint whose config names an image-text model class")

    def _setup_text(self) -> None:
        """The answer-stop rule and prefix stability, checked and stated."""
        config = self.config
        if config.settings.answer_stop == "eos" and self.tokenizer.eos_token_id is None:
            raise ValueError(f"model.auto.answer_stop=eos: the tokenizer of model.path={config.path} has no EOS token "
                             "to append; set its eos_token, or model.auto.answer_stop=template")
        if self._template_answer_end[0] == "none" and config.settings.answer_stop == "template":
            log.warning(
                "model.path=%s: its chat template renders no stop token (%s) in or right after an assistant "
                "answer, so a model trained on it as rendered does not learn to end its answers; set "
                "model.auto.answer_stop=eos to append %r to every answer, labelled", config.path,
                self.tokenizer.convert_ids_to_tokens(self.stop_token_ids), self.tokenizer.eos_token)
        self.prefix_stable = self._prefix_stable
        self._state_policy()

    def _state_policy(self) -> None:
        """Say at start-up how answers are labelled where that is not the obvious rule."""
        prefix, _ = self._text_change
        if prefix:
            log.info("model.path=%s: its processor adds %r before every text it is given; mmtune adds it too",
                     self.config.path, prefix)
        if not self._prefix_stable:
            log.warning(
                "model.path=%s: its chat template renders earlier turns differently as turns are added (not "
                "prefix-stable: e.g. a thinking block only in answers after the last user turn). Each dialogue is "
                "rendered whole once; every answer is trained as the template shows it in that dialogue (earlier "
                "answers as it shows them in context, e.g. without their thinking), and generation prompts are the "
                "template's own", self.config.path)

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

"""Multi-turn, multi-image generation for evaluation, with the KV cache kept across turns.

A dialogue is answered turn by turn: the prompt of turn ``t`` holds every earlier user
turn, the model's OWN earlier answers (not the references) and every image introduced
so far, then the generation prompt. That prompt is a prefix-extension of what the model
has already processed, so the KV path (``kv_reuse``, default) keeps a transformers
``DynamicCache`` per dialogue and feeds only the tokens after the longest common prefix
(with ``pixel_values`` of the images that start in them). The prefix is recomputed by
comparing ids, not assumed: when re-tokenizing an answer gives other ids than the ones
generated, or the overflow policy dropped turns, the cache is cropped back to the
common prefix (never into the middle of an image) and the rest is fed again. So both
paths see exactly the same prompt ids; a test checks that their answers are identical.

``batch_size`` dialogues are answered together. On the KV path they share one batched
cache (:class:`~mmtune.evaluation.generation.batched_kv.BatchedKVCache`) and every forward step
serves all rows at once: a row starting a turn feeds only that turn's new tokens (the
user turn with its images), a row mid-answer feeds its last token, right-padded within
the step, with an attention mask that hides every other column and position ids that
count the row's own tokens (for sliding-window layers also the masks, which count the window in
the row's own tokens: see ``_windowed_masks``). A row whose answer ends starts its next turn at the next
step; a row whose dialogue is done takes the next dialogue (continuous batching). With
greedy decoding the answers are those of one dialogue at a time, which tests check on
LLaVA and XComposer2. The re-encode path (``kv_reuse: false``) encodes the whole
history every turn, left-padded, ``batch_size`` dialogues per forward pass.

Context overflow: when ``prompt + min_new_tokens`` exceeds the window, ``drop_oldest``
drops the oldest exchanges (their images are carried into the first kept user turn when
a kept turn names them, e.g. "Image1"), ``stop`` answers no more turns of the dialogue.
Each turn's record says what happened.

Every turn's record is appended to a JSONL file and flushed as soon as it exists
(:class:`~mmtune.evaluation.generation.records.GenerationsFile`); a restart skips
finished turns and rebuilds the history of a half-done dialogue from the recorded
answers. A restart only resumes answers of the same run: ``<file>.settings.json`` keys
the file on the decoding settings, the weights (a fingerprint of the loaded model plus
the checkpoint's name) and the data file (path, size, mtime), and every resumed record's
question must equal the dialogue's; anything else raises :class:`StaleGenerationsError`
naming the run that wrote the file. A finished run leaves the file in dialogue and turn
order.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.evaluation.generation.batched_kv import BatchedKVCache
from mmtune.evaluation.generation.config import GenerationConfig
from mmtune.evaluation.generation.records import (
    GenerationsFile,
    StaleGenerationsError,
    TurnRecord,
    question_text,
    read_generations,
)
from mmtune.evaluation.generation.throughput import resolve_batch_size
from mmtune.models.base import ImageChunk, ModelAdapter

__all__ = ["TurnRecord", "DialogueGenerator", "StaleGenerationsError", "flatten", "question_text", "read_generations"]

log = logging.getLogger(__name__)


def flatten(encoded: Any, image_token_id: int) -> tuple[list[int], list[Image], list[tuple[int, int]]]:
    """An encoded dialogue as one id list, its images in order and each image's token span."""
    ids: list[int] = []
    images: list[Image] = []
    spans: list[tuple[int, int]] = []
    chunks = list(encoded.prefix) + [c for t in encoded.turns for c in t.chunks] + list(encoded.suffix)
    for chunk in chunks:
        if isinstance(chunk, ImageChunk):
            spans.append((len(ids), len(ids) + chunk.num_tokens))
            images.append(chunk.image)
            ids.extend(chunk.token_ids(image_token_id))
        else:
            ids.extend(chunk.ids)
    return ids, images, spans


@dataclass
class _State:
    dialogue: Dialogue
    answers: list[Optional[str]] = field(default_factory=list)
    dropped: int = 0
    stopped: bool = False
    cache: Any = None
    cached_ids: list[int] = field(default_factory=list)


@dataclass
class _Slot:
    """A row of the batched KV path: its dialogue, the exchange it answers and how far it got."""

    state: _State
    turn: int = 0
    prompt: Optional[tuple] = None
    """The turn's prompt (ids, images, spans, overflow info); ``None`` between turns."""
    feed: Optional[list[int]] = None
    """Prompt tokens still to prefill (``None`` once prefilled: the row is decoding)."""
    image_paths: list[str] = field(default_factory=list)
    feed_rows: Any = None
    """Position rows [R, len(feed)] of the tokens to prefill, for a multi-row (M-RoPE) adapter."""
    delta: int = 0
    """The prompt's position offset: a generated token at index ``i`` has position ``i + delta``."""
    generated: list[int] = field(default_factory=list)
    fed: int = 0
    max_new: int = 0
    processors: Any = None
    history: Any = None
    """The row's prompt and answer so far [1, L], on the model's device, for the processors."""
    last_token: Any = None


# Compact the batched cache once more than this fraction of it is holes: a compaction
# copies the cache once (about one decode step's memory traffic), holes cost memory and
# attention time at every step.
_COMPACT_HOLES = 0.25


def _layer_windows(text_config: Any) -> Optional[dict[str, Optional[int]]]:
    """Layer type -> its attention window (``None``: the whole past, or the chunk of
    :func:`_layer_chunks`) of a language model with sliding-window or chunked-attention layers;
    ``None`` for one that attends to the whole past everywhere."""
    window = getattr(text_config, "sliding_window", None)
    types = list(getattr(text_config, "layer_types", None) or [])
    if set(types) - {"full_attention", "sliding_attention", "chunked_attention"}:  # linear ...: transformers' own
        return None
    windowed = window is not None and (not types or "sliding_attention" in types)
    if not windowed and not _layer_chunks(text_config):
        return None
    return {kind: (int(window) if kind == "sliding_attention" else None) for kind in (types or ["sliding_attention"])}


def _layer_chunks(text_config: Any) -> dict[str, int]:
    """Layer type -> its attention chunk (Llama 4's ``chunked_attention`` layers: a token sees the
    tokens of its own chunk of ``attention_chunk_size`` positions), for the layers that have one."""
    chunk = getattr(text_config, "attention_chunk_size", None)
    types = list(getattr(text_config, "layer_types", None) or [])
    return {"chunked_attention": int(chunk)} if chunk and "chunked_attention" in types else {}


def _column_limit(text_config: Any) -> Optional[int]:
    """The most cache columns with which rows stay independent, or ``None`` for no limit. Llama 4's
    NoPE layers scale queries by ``log1p(floor((p + 1) / floor_scale))`` of a position ``p`` taken from
    the cache's length, shared by the rows: the scale is 1 for every row while the cache has fewer
    than ``floor_scale`` columns."""
    if getattr(text_config, "attn_temperature_tuning", False) and getattr(text_config, "floor_scale", None):
        return int(text_config.floor_scale) - 1
    return None


def _reusable_prefix(ids: list[int], cached: list[int], spans: list[tuple[int, int]]) -> int:
    """How many leading tokens of ``ids`` a cache holding ``cached`` can keep.

    The longest common prefix, less one (at least one token must be fed to get the
    logits of the next position), moved back to an image's start if it ends inside one
    (an image's features come in one piece)."""
    common = 0
    limit = min(len(ids), len(cached))
    while common < limit and ids[common] == cached[common]:
        common += 1
    common = min(common, len(ids) - 1)
    for start, end in spans:
        if start < common < end:
            common = start
    return common


_IMAGE_NAME = re.compile(r"\bimage\s*(\d+)\b", re.IGNORECASE)


class DialogueGenerator:
    """Answers dialogues turn by turn with an adapter's chat template.

    Args:
        adapter: the model family's adapter (template, image preprocessing, stop ids).
        model: the loaded model (``adapter.load_model()``), in eval mode.
        config: decoding, batching and overflow settings.
    """

    prefill_policy: str
    """Batched KV path: ``continuous`` (a row starts its next turn as soon as its answer
    ends) or ``lockstep`` (rows start turns together, after the longest answer); from
    ``config.batch_schedule``, ``auto`` resolved by device."""

    def __init__(self, adapter: ModelAdapter, model: Any, config: GenerationConfig):
        import torch

        self.adapter = adapter
        self.model = model.eval()
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        schedule = config.batch_schedule
        if schedule == "auto":  # see GenerationConfig.batch_schedule and bench/eval_generation.py
            schedule = "continuous" if self.device.type == "cuda" else "lockstep"
        self.prefill_policy = schedule
        # peft wrappers forward **kwargs; the wrapped model's signature names the cache argument
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        params = inspect.signature(inner.forward).parameters
        # transformers 5.x names the cache argument ``cache``; older and remote-code models ``past_key_values``.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        window = config.context_length
        if window is None:
            text_cfg = adapter.text_config(model.config)
            window = int(getattr(text_cfg, "max_position_embeddings", 0) or 0) or None
        self.context_length = window
        self._windows = _layer_windows(adapter.text_config(model.config))
        self._chunks = _layer_chunks(adapter.text_config(model.config))
        self._column_limit = _column_limit(adapter.text_config(model.config))
        self.pad_id = adapter.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = adapter.stop_token_ids[0]
        self._generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.batch_size = resolve_batch_size(config, sum(p.numel() for p in model.parameters()))
        self.batch_note = self._rows_depend_on_each_other()
        """Why ``batch_size`` was lowered to 1 (``None`` when it was not); in every result's meta."""
        if self.batch_note and self.batch_size > 1:
            log.warning("%s", self.batch_note)
            self.batch_size = 1
        elif self.batch_note:
            self.batch_note = None
        self._recurrent = self._has_recurrent_layers()
        self.kv_note = self._batched_kv_refused()
        """Why batched rows re-encode each turn instead of sharing a KV cache (``None``: they share one)."""
        if self.kv_note:
            log.warning("%s", self.kv_note)
        # forward_tokens: real tokens run through the model; padding_tokens: pad positions fed
        # alongside them (batching), of which idle_tokens are decode steps of rows whose answer
        # had already ended; forward_calls: model calls; compactions: batched-cache compactions
        self.stats = {"forward_tokens": 0, "prompt_tokens": 0, "turns": 0, "forward_calls": 0, "padding_tokens": 0,
                      "idle_tokens": 0, "compactions": 0}

    def _has_recurrent_layers(self) -> bool:
        """Whether the model's cache holds recurrent states (Qwen3.5's Gated DeltaNet layers): a state
        sums every token it has seen, so it cannot be cut back to a prefix (``Cache.crop`` refuses
        it) and a padding token fed into it changes it."""
        return any(hasattr(layer, "recurrent_states") for layer in getattr(self._new_cache(), "layers", []))

    def _batched_kv_refused(self) -> Optional[str]:
        """Why ``batch_size`` rows cannot share one KV cache, or ``None``: the batched cache rolls rows
        back by masking columns and pads rows within a step, neither of which a recurrent state allows.
        Such rows take the exact batched path, re-encoding each turn (left padding before a zero state
        leaves it zero)."""
        if not (self._recurrent and self.config.kv_reuse and self.batch_size > 1):
            return None
        return (f"eval.generation.batch_size={self.batch_size}: the model's language model has recurrent "
                "(linear-attention or short-convolution) layers, whose state cannot be rolled back per row nor padded "
                "within a step, so "
                "batched rows re-encode each turn's whole prompt (as kv_reuse: false); batch_size: 1 keeps the KV "
                "cache, prefilling again from the start where a turn's prompt does not extend the cached one")

    def _rows_depend_on_each_other(self) -> Optional[str]:
        """Why rows of one batch would change each other's answers, or ``None``.

        transformers' dynamic RoPE (``dynamic`` NTK scaling, ``longrope``) rescales the
        rotary frequencies from the largest position in the whole batch once it passes the
        model's original window, so past that window one row's rotary angles would depend
        on the other rows. Within the window (``context_length`` at most the original one)
        the scaling never starts and rows stay independent."""
        text_cfg = self.adapter.text_config(self.model.config)
        limit = _column_limit(text_cfg)
        if limit is not None and (self.context_length is None or self.context_length > limit):
            return (f"eval.generation.batch_size={self.config.batch_size} runs as 1: the model's NoPE layers scale "
                    f"queries from the cache's length once it reaches floor_scale={limit + 1} tokens, and a batched "
                    f"cache's length is the longest row's, so past context_length {limit} (it is "
                    f"{self.context_length}) batched rows would change each other's answers")
        params = getattr(text_cfg, "rope_parameters", None) or {}
        rope_type = str(params.get("rope_type", "default")) if isinstance(params, dict) else "default"
        if "dynamic" not in rope_type and rope_type != "longrope":
            return None
        original = int(params.get("original_max_position_embeddings") or getattr(text_cfg, "max_position_embeddings", 0)
                       or 0)
        if self.context_length is not None and original and self.context_length <= original:
            return None
        return (f"eval.generation.batch_size={self.config.batch_size} runs as 1: the model scales RoPE dynamically "
                f"(rope_type {rope_type}) and generation may go past its original {original or '?'}-token window "
                f"(context_length {self.context_length}), where transformers rescales from the longest row of a batch, "
                "so batched rows would change each other's answers")

    def _image_inputs(self, paths: Sequence[str]) -> dict[str, Any]:
        """The adapter's image inputs of ``paths`` on the model's device (floating ones in its dtype)."""
        inputs = self.adapter.image_inputs(list(paths))
        return {k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                for k, v in inputs.items()}

    def _prompt_rows(self, ids: list[int], images: Sequence[Any]) -> tuple[Any, int]:
        """Position rows [R, L] of a whole prompt and its offset, for a multi-row (M-RoPE) adapter;
        ``(None, 0)`` for one row (its positions are each row's own token count)."""
        if self.adapter.position_id_rows == 1:
            return None, 0
        import torch

        paths = [img.path if isinstance(img, Image) else img for img in images]
        rows, delta = self.adapter.prompt_positions(torch.tensor(ids, dtype=torch.long), paths)
        return rows.to(self.device), delta

    def _position_ids(self, text: Any, rows: list[tuple[Any, int, int]]) -> Any:
        """The forward's ``position_ids`` of one step from ``text`` [B, W] (each row's own token
        positions) and, per row, ``(prefill rows [R, n] or None, first column, delta)``: prefill
        columns take the prompt's rows, every other column ``text + delta`` in all rows (a
        generated token, or padding). One-row adapters: ``text`` as it is."""
        if self.adapter.position_id_rows == 1:
            return text
        out = text[None].repeat(self.adapter.position_id_rows, 1, 1)
        for b, (prefill, start, delta) in enumerate(rows):
            out[:, b] += delta
            if prefill is not None and prefill.shape[1]:
                out[:, b, start : start + prefill.shape[1]] = prefill
        return self.adapter.model_position_ids(out, text)

    # ------------------------------------------------------------------ prompts
    def _history(self, state: _State, t: int, drop: int) -> tuple[Dialogue, int]:
        """The dialogue as the model sees it before answering exchange ``t``, oldest ``drop`` exchanges removed."""
        dialogue = state.dialogue
        exchanges = list(dialogue.exchanges())
        system = [dialogue.turns[0]] if dialogue.turns and dialogue.turns[0].role == "system" else []
        kept = []
        for j in range(drop, t + 1):
            u, _ = exchanges[j]
            kept.append(dialogue.turns[u])
            if j < t:
                kept.append(Turn("assistant", (state.answers[j] or "",)))
        carried = 0
        if drop:
            # images introduced in dropped turns, numbered in order of appearance
            order = {img.path: i + 1 for i, img in enumerate(dialogue.images)}
            named = {int(n) for turn in kept for n in _IMAGE_NAME.findall(turn.text)}
            lost = [img for j in range(drop) for img in dialogue.turns[exchanges[j][0]].images]
            keep_segments: list[Any] = []
            for img in lost:
                if order.get(img.path) in named:
                    keep_segments += [f"Image{order[img.path]}: ", img, "\n"]
                    carried += 1
            if keep_segments:
                kept[0] = Turn("user", tuple(keep_segments) + kept[0].segments)
        return Dialogue(dialogue.id, dialogue.source, tuple(system + kept), dialogue.meta), carried

    def _encode(self, dialogue: Dialogue) -> tuple[list[int], list[Image], list[tuple[int, int]]]:
        encoded = self.adapter.encode_dialogue(dialogue, system_prompt=self.config.system_prompt, add_generation_prompt=True)
        return flatten(encoded, self.adapter.image_token_id)

    def _prompt(self, state: _State, t: int) -> Optional[tuple[list[int], list[Image], list[tuple[int, int]], Optional[dict]]]:
        """Prompt ids for exchange ``t`` after the overflow policy; None = skip (dialogue stopped)."""
        if state.stopped:
            return None
        window = self.context_length
        drop = state.dropped
        while True:
            history, carried = self._history(state, t, drop)
            ids, images, spans = self._encode(history)
            if window is None or len(ids) + self.config.min_new_tokens <= window:
                break
            if self.config.overflow == "stop" or drop >= t:
                state.stopped = True
                return None
            drop += 1
        state.dropped = drop
        info = None
        if drop:
            info = {"policy": "drop_oldest", "dropped_exchanges": drop, "carried_images": carried}
        return ids, images, spans, info

    # ------------------------------------------------------------------ decoding
    def _logits_processors(self):
        from transformers import (
            LogitsProcessorList,
            RepetitionPenaltyLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopPLogitsWarper,
        )

        processors = LogitsProcessorList()
        # Special tokens other than the stop tokens are never generated: decoding drops them
        # from the answer text, and an image placeholder would reach the next prompt
        # without pixels.
        tok = self.adapter.tokenizer
        special = set(getattr(tok, "all_special_ids", [])) | {self.adapter.image_token_id}
        banned = special - {None} - set(self.adapter.stop_token_ids)
        processors.append(SuppressTokensLogitsProcessor(sorted(banned), device=self.device))
        if self.config.repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(self.config.repetition_penalty))
        if self.config.do_sample:
            processors.append(TemperatureLogitsWarper(self.config.temperature))
            if self.config.top_p < 1.0:
                processors.append(TopPLogitsWarper(self.config.top_p))
        return processors

    def _forward(self, ids, images, mask, positions, cache, keep: Any = 1):
        """One model call; ``images``: the step's image inputs (a dict, or ``pixel_values`` alone), or ``None``."""
        kwargs = {self._cache_kw: cache, "use_cache": True}
        inputs = {name: None for name in self.adapter.image_input_names}
        if images is not None:
            inputs.update(images if isinstance(images, dict) else {"pixel_values": images})
        self.stats["forward_calls"] += 1
        attention = mask if self._windows is None else self._windowed_masks(mask, int(ids.shape[1]))
        out = self.model(
            input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=keep, **inputs, **kwargs
        )
        return out.logits[:, -1, :].float()

    def _decode(
        self,
        rows: list[list[int]],
        image_paths: list[str],
        cache: Any,
        past: int,
        max_new: list[int],
        contexts: list[list[int]],
        context_images: Optional[list[list[Any]]] = None,
    ) -> list[tuple[list[int], str, int]]:
        """Prefill ``rows`` (left-padded; ``past`` cached tokens before them) and decode greedily
        or by sampling. ``contexts`` are the rows' whole prompts (``rows`` their last tokens) and
        ``context_images`` those prompts' images, for multi-row positions. Returns per row:
        generated ids (stop token excluded), finish reason and the tokens this row ran through
        the model."""
        import torch

        B, L = len(rows), max(len(r) for r in rows)
        pads = [L - len(r) for r in rows]
        ids = torch.tensor([[self.pad_id] * p + r for p, r in zip(pads, rows)], dtype=torch.long, device=self.device)
        mask = torch.ones(B, past + L, dtype=torch.long, device=self.device)
        for b, p in enumerate(pads):
            mask[b, past : past + p] = 0
        positions = (torch.arange(L, device=self.device).unsqueeze(0) - torch.tensor(pads, device=self.device).unsqueeze(1)).clamp(min=0) + past
        prompt_rows = [self._prompt_rows(c, imgs) for c, imgs in zip(contexts, context_images or [[] for _ in rows])]
        # each row's prefill columns take the rows of its last len(rows[b]) prompt tokens
        row_positions = [(None if r is None else r[:, len(c) - len(row):], pad, delta)
                         for (r, delta), c, row, pad in zip(prompt_rows, contexts, rows, pads)]
        deltas = [(None, 0, delta) for _, delta in prompt_rows]
        images = self._image_inputs(image_paths) if image_paths else None
        processors = self._logits_processors()
        stops = set(self.adapter.stop_token_ids)
        generated: list[list[int]] = [[] for _ in range(B)]
        finish = [""] * B
        fed = [len(r) for r in rows]
        history = torch.tensor([[self.pad_id] * p + c for p, c in zip([max(len(c) for c in contexts) - len(c) for c in contexts], contexts)], device=self.device)
        logits = self._forward(ids, images, mask, self._position_ids(positions, row_positions), cache)
        self.stats["padding_tokens"] += sum(pads)
        last_pos = positions[:, -1]
        step = 0
        while True:
            scores = processors(history, logits)
            if self.config.do_sample:
                probs = torch.softmax(scores, dim=-1).cpu()
                next_ids = torch.multinomial(probs, 1, generator=self._generator).squeeze(1).to(self.device)
            else:
                next_ids = scores.argmax(dim=-1)
            step += 1
            for b in range(B):
                if finish[b]:
                    continue
                token = int(next_ids[b])
                if token in stops:
                    finish[b] = "stop"
                else:
                    generated[b].append(token)
                    if len(generated[b]) >= max_new[b]:
                        finish[b] = "length"
            if all(finish):
                break
            # finished rows keep decoding a pad token (masked out) so the batch stays rectangular
            feed = torch.where(torch.tensor([bool(f) for f in finish], device=self.device), torch.full_like(next_ids, self.pad_id), next_ids)
            for b in range(B):
                if not finish[b]:
                    fed[b] += 1
            self.stats["padding_tokens"] += sum(1 for f in finish if f)
            self.stats["idle_tokens"] += sum(1 for f in finish if f)
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            history = torch.cat([history, feed.unsqueeze(1)], dim=1)
            logits = self._forward(feed.unsqueeze(1), None, mask, self._position_ids(last_pos.unsqueeze(1), deltas), cache)
        return [(generated[b], finish[b], fed[b]) for b in range(B)]

    def _new_cache(self):
        from transformers import DynamicCache

        if self._windows is not None:
            # full layers for windowed and chunked ones too: a sliding layer drops what falls out of its window,
            # so it could not be cropped back to a common prefix nor compacted; the window is kept by
            # the masks of _windowed_masks instead
            return DynamicCache()
        return DynamicCache(config=self.model.config)

    def _windowed_masks(self, mask, q_length: int):
        """The attention masks of a model with sliding-window layers, from the 2-D column mask
        ``mask`` [B, K] (1: a column holding one of the row's tokens) for the last ``q_length``
        columns: each query sees the row's tokens at positions up to its own and, in a windowed
        layer, less than the window before it (what a sliding cache of one row keeps), in a chunked
        layer (Llama 4's), only those of its own chunk, counted in the row's own tokens, not columns
        (the batched cache has holes). A query on padding sees
        itself too, so no row of the mask is empty. One 4-D mask when every layer is of one type;
        else transformers' mapping of layer type to mask, which such models take in place of a 2-D
        one."""
        import torch
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        batch, width = int(mask.shape[0]), int(mask.shape[1])
        position = mask.long().cumsum(1) - 1  # a column's position among the row's tokens
        gap = position[:, width - q_length:, None] - position[:, None, :]  # [B, Q, K]
        seen = mask.bool()[:, None, :] & (gap >= 0)
        own = torch.arange(width - q_length, width, device=mask.device)[:, None] == torch.arange(width, device=mask.device)
        make = ALL_MASK_ATTENTION_FUNCTIONS[self.model.config.get_text_config()._attn_implementation]
        out = {}
        for layer_type, window in self._windows.items():
            allowed = seen & (gap < window) if window is not None else seen
            chunk = self._chunks.get(layer_type)
            if chunk is not None:  # the chunks count the row's own positions from 0
                allowed = allowed & (position[:, width - q_length:, None] // chunk == position[:, None, :] // chunk)
            allowed = allowed | own
            out[layer_type] = make(batch_size=batch, q_length=q_length, kv_length=width,
                                   mask_function=lambda b, h, q, kv, a=allowed: a[b, q, kv],
                                   allow_is_causal_skip=False, dtype=self.dtype, device=mask.device)
        return next(iter(out.values())) if len(out) == 1 else out

    def _answer_text(self, ids: list[int]) -> str:
        return self.adapter.tokenizer.decode(ids, skip_special_tokens=True).strip()

    def _max_new(self, prompt_len: int) -> int:
        if self.context_length is None:
            return self.config.max_new_tokens
        return max(1, min(self.config.max_new_tokens, self.context_length - prompt_len))

    # ------------------------------------------------------------------ one turn, KV path
    def _turn_kv(self, state: _State, ids: list[int], images: list[Image], spans: list[tuple[int, int]]):
        import torch

        with torch.inference_mode():
            common = _reusable_prefix(ids, state.cached_ids, spans)
            if state.cache is None or common == 0:
                state.cache, common = self._new_cache(), 0
            else:
                extra = int(state.cache.get_seq_length()) - common
                if extra > 0 and self._recurrent:  # a recurrent state cannot be cut back: prefill again
                    state.cache, common = self._new_cache(), 0
                elif extra > 0:
                    state.cache.crop(-extra)
            new_images = [img.path for img, (start, _) in zip(images, spans) if start >= common]
            [(gen, finish, fed)] = self._decode([ids[common:]], new_images, state.cache, common, [self._max_new(len(ids))],
                                                [ids], [images])
        # the cache now holds the prompt and every generated token except the last one sampled
        state.cached_ids = ids + gen[: max(0, fed - (len(ids) - common))]
        return gen, finish, fed

    # ------------------------------------------------------------------ batched KV path
    def _advance(self, slot: _Slot, done: dict, emit: Any, bar: Any) -> Optional[tuple]:
        """Move ``slot`` to its next turn that needs the model and return that turn's prompt;
        ``None`` when the dialogue has no such turn left. Turns already on disk are passed
        over, turns the overflow policy skips are recorded on the way."""
        state = slot.state
        while slot.turn < len(state.answers):
            if (state.dialogue.id, slot.turn) not in done:
                prompt = self._prompt(state, slot.turn)
                if prompt is not None:
                    return prompt
                emit(self._records_for(state, slot.turn, None, [], "", 0))
                bar.update(1)
            slot.turn += 1
        return None

    def _start_turn(self, kv: BatchedKVCache, row: int, slot: _Slot, prompt: tuple) -> None:
        """Roll ``row`` of the cache back to what the prompt shares with it; queue the rest as the row's prefill."""
        ids, images, spans, _ = prompt
        common = _reusable_prefix(ids, kv.ids[row], spans)
        kv.keep(row, common)
        slot.prompt = prompt
        slot.feed = ids[common:]
        slot.image_paths = [img.path for img, (start, _) in zip(images, spans) if start >= common]
        rows, slot.delta = self._prompt_rows(ids, images)
        slot.feed_rows = None if rows is None else rows[:, common:]
        slot.generated, slot.fed, slot.max_new = [], len(slot.feed), self._max_new(len(ids))
        slot.processors = self._logits_processors()
        slot.history = None

    def _scores(self, slot: _Slot, logits: Any) -> Any:
        """The row's logits [1, V] through the row's own logits processors (they see its own history)."""
        import torch

        if slot.history is None:
            slot.history = torch.tensor([slot.prompt[0]], dtype=torch.long, device=self.device)
        else:
            slot.history = torch.cat([slot.history, slot.last_token], dim=1)
        return slot.processors(slot.history, logits)

    def _generate_batched_kv(self, states: list[_State], done: dict, emit: Any, bar: Any) -> None:
        """Continuous batching over ``batch_size`` rows of one batched cache.

        Every forward step, each row does what its dialogue needs next: a row starting a
        turn feeds the prompt tokens after the prefix its cache row still holds (the user
        turn and its images), a row in the middle of an answer feeds its last token. So a
        row whose answer ends starts its next turn at the next step instead of waiting for
        the longest answer of the batch. A row whose dialogue is done takes the next
        dialogue (its old cache row is forgotten, not freed: the holes go at the next
        compaction); when no dialogue is left, the row leaves the batch. With
        ``prefill_policy = "lockstep"`` a row that finished its answer waits until every
        row has, and all start their next turn together.
        """
        import torch

        remaining = {id(s): sum((s.dialogue.id, t) not in done for t in range(len(s.answers))) for s in states}
        # Dialogues with the most turns left go first, so the last rows to run alone (the
        # batch shrinks once the queue is empty) are short dialogues.
        queue = deque(sorted((s for s in states if remaining[id(s)]), key=lambda s: -remaining[id(s)]))
        slots: list[Optional[_Slot]] = [None] * min(self.batch_size, len(queue))
        if not slots:
            return
        stops = set(self.adapter.stop_token_ids)
        # the cache bookkeeping edits tensors made under inference mode, so all of it runs there
        with torch.inference_mode():
            kv = BatchedKVCache(self._new_cache, len(slots), self.device)
            while True:
                mid_turn = any(s is not None and s.prompt is not None for s in slots)
                for row, slot in enumerate(slots):
                    if slot is not None and slot.prompt is not None:
                        continue  # prefilling or decoding
                    if mid_turn and self.prefill_policy == "lockstep":
                        continue  # waits for the other rows' answers
                    prompt = self._advance(slot, done, emit, bar) if slot is not None else None
                    while prompt is None and queue:
                        slot = slots[row] = _Slot(queue.popleft())
                        kv.keep(row, 0)  # the new dialogue shares nothing with the old one
                        prompt = self._advance(slot, done, emit, bar)
                    if prompt is None:
                        slots[row] = None
                    else:
                        self._start_turn(kv, row, slot, prompt)
                live = [row for row, slot in enumerate(slots) if slot is not None]
                if not live:
                    break
                if len(live) < kv.batch_size:
                    kv.select(live)
                    slots = [slots[r] for r in live]
                if kv.holes() > _COMPACT_HOLES or self._over_column_limit(kv, slots):
                    kv.compact()
                    self.stats["compactions"] += 1
                self._batched_step(kv, slots, stops, emit, bar)

    def _over_column_limit(self, kv: BatchedKVCache, slots: list[_Slot]) -> bool:
        """Whether the next step would take the cache past :func:`_column_limit` (holes included):
        compacting first keeps it at the longest row's length, within the context length."""
        if self._column_limit is None:
            return False
        width = max((len(s.feed) if s.prompt is not None and s.feed is not None else 1) for s in slots)
        return kv.length + width > self._column_limit

    def _batched_step(self, kv: BatchedKVCache, slots: list[_Slot], stops: set[int], emit: Any, bar: Any) -> None:
        """One forward pass of every row: prefilling rows feed their new prompt tokens, decoding
        rows their last token, waiting rows (lockstep) a pad; then each row's next token."""
        import torch

        tokens, image_paths, rows = [], [], []
        for slot in slots:
            if slot.prompt is None:
                tokens.append([])  # waiting (lockstep)
                rows.append((None, 0, slot.delta))
            elif slot.feed is not None:
                tokens.append(slot.feed)
                image_paths += slot.image_paths
                rows.append((slot.feed_rows, 0, slot.delta))
            else:
                tokens.append([slot.generated[-1]])
                rows.append((None, 0, slot.delta))
        width = max(len(t) for t in tokens)
        ids = torch.tensor([t + [self.pad_id] * (width - len(t)) for t in tokens], dtype=torch.long, device=self.device)
        positions, last = kv.extend(tokens, width)
        # images in the row-major order of their tokens: the order the model splices them in
        images = self._image_inputs(image_paths) if image_paths else None
        logits = self._forward(ids, images, kv.mask, self._position_ids(positions, rows), kv.cache, keep=last)
        self.stats["padding_tokens"] += len(tokens) * width - sum(len(t) for t in tokens)
        self.stats["idle_tokens"] += sum(1 for t in tokens if not t)
        active = [b for b in range(len(slots)) if tokens[b]]
        scores = torch.cat([self._scores(slots[b], logits[b : b + 1]) for b in active])
        if self.config.do_sample:
            probs = torch.softmax(scores, dim=-1).cpu()
            picks = torch.multinomial(probs, 1, generator=self._generator).squeeze(1).to(self.device)
        else:
            picks = scores.argmax(dim=-1)
        for i, (b, token) in enumerate(zip(active, picks.tolist())):
            slot = slots[b]
            if slot.feed is None:
                slot.fed += 1
            slot.feed, slot.image_paths = None, []
            slot.last_token = picks[i : i + 1].unsqueeze(1)
            finish = ""
            if token in stops:
                finish = "stop"
            else:
                slot.generated.append(token)
                if len(slot.generated) >= slot.max_new:
                    finish = "length"
            if finish:
                slot.state.answers[slot.turn] = self._answer_text(slot.generated)
                emit(self._records_for(slot.state, slot.turn, slot.prompt, slot.generated, finish, slot.fed))
                bar.update(1)
                slot.turn += 1
                slot.prompt = None

    # ------------------------------------------------------------------ driver
    def _records_for(self, state: _State, t: int, prompt, gen, finish, fed) -> TurnRecord:
        dialogue = state.dialogue
        u, a = list(dialogue.exchanges())[t]
        reference = dialogue.turns[a].text if a < len(dialogue.turns) else None
        if prompt is None:
            return TurnRecord(dialogue.id, t, question_text(dialogue.turns[u]), None, reference, 0, 0, 0, "context",
                              {"policy": self.config.overflow, "stopped": True})
        ids, _, _, info = prompt
        answer = self._answer_text(gen)
        self.stats["forward_tokens"] += fed
        self.stats["prompt_tokens"] += len(ids)
        self.stats["turns"] += 1
        return TurnRecord(dialogue.id, t, question_text(dialogue.turns[u]), answer, reference, len(ids), fed, len(gen), finish, info)

    def generate(
        self,
        dialogues: Sequence[Dialogue],
        *,
        out_path: Optional[str | os.PathLike] = None,
        progress: bool = False,
        run_key: Optional[dict[str, Any]] = None,
        resume_from: Sequence[str | os.PathLike] = (),
    ) -> list[TurnRecord]:
        """Answer every user turn of ``dialogues``; append each record to ``out_path`` at once.

        Turns already in ``out_path`` (or in a ``resume_from`` file) are not generated
        again (resume); their answers are used as the history of the dialogue's remaining
        turns. ``run_key`` names what else the answers depend on (``{"checkpoint": ...,
        "data": ...}``) and ``{"about": {...}}`` describes the run for messages; both go to
        the settings file. Once every turn is answered, ``out_path`` is rewritten in
        dialogue and turn order (:meth:`GenerationsFile.finish`).

        The file is locked while it is written (:class:`GenerationsFile`): a second process
        answering into it is refused instead of appending to the same file.

        Raises:
            StaleGenerationsError: ``out_path`` holds answers of another run, or was started by one.
            DirectoryLockedError: another process is writing the same generations file.

        Returns:
            All records of ``dialogues`` (old and new), in dialogue and turn order.
        """
        import torch
        from tqdm.auto import tqdm

        done: dict[tuple[str, int], dict[str, Any]] = {}
        file = None
        if out_path is not None:
            file = GenerationsFile(out_path, self._settings(run_key), dialogues, resume_from=resume_from)
            done = file.done
        records: dict[tuple[str, int], TurnRecord] = {k: TurnRecord(**v) for k, v in done.items()}

        def emit(record: TurnRecord) -> None:
            records[(record.dialogue_id, record.turn)] = record
            if file is not None:
                file.append(record)

        states = []
        for dialogue in dialogues:
            n = len(list(dialogue.exchanges()))
            state = _State(dialogue, answers=[None] * n)
            for t in range(n):
                old = done.get((dialogue.id, t))
                if old is not None:
                    state.answers[t] = old["answer"]
                    if old["finish_reason"] == "context":
                        state.stopped = True
                    if old.get("context") and old["context"].get("dropped_exchanges"):
                        state.dropped = max(state.dropped, int(old["context"]["dropped_exchanges"]))
            states.append(state)
        todo = sum(1 for s in states for t in range(len(s.answers)) if (s.dialogue.id, t) not in done)
        bar = tqdm(total=todo, desc="generating", disable=not progress)
        try:
            if self.config.kv_reuse and self.batch_size > 1 and self.kv_note is None:
                self._generate_batched_kv(states, done, emit, bar)
            elif self.config.kv_reuse and self.batch_size == 1:
                for state in states:
                    for t in range(len(state.answers)):
                        if (state.dialogue.id, t) in done:
                            continue
                        prompt = self._prompt(state, t)
                        gen, finish, fed = ([], "", 0)
                        if prompt is not None:
                            gen, finish, fed = self._turn_kv(state, *prompt[:3])
                            state.answers[t] = self._answer_text(gen)
                        emit(self._records_for(state, t, prompt, gen, finish, fed))
                        bar.update(1)
                    state.cache, state.cached_ids = None, []  # free the dialogue's KV memory
            else:
                size = self.batch_size
                for start in range(0, len(states), size):
                    group = states[start : start + size]
                    for t in range(max((len(s.answers) for s in group), default=0)):
                        active = [s for s in group if t < len(s.answers) and (s.dialogue.id, t) not in done]
                        prompts = [(s, self._prompt(s, t)) for s in active]
                        for s, p in prompts:
                            if p is None:
                                emit(self._records_for(s, t, None, [], "", 0))
                                bar.update(1)
                        ready = [(s, p) for s, p in prompts if p is not None]
                        if not ready:
                            continue
                        with torch.inference_mode():
                            outs = self._decode(
                                [p[0] for _, p in ready],
                                [img.path for _, p in ready for img in p[1]],
                                self._new_cache(),
                                0,
                                [self._max_new(len(p[0])) for _, p in ready],
                                [p[0] for _, p in ready],
                                [p[1] for _, p in ready],
                            )
                        for (s, p), (gen, finish, fed) in zip(ready, outs):
                            s.answers[t] = self._answer_text(gen)
                            emit(self._records_for(s, t, p, gen, finish, fed))
                            bar.update(1)
        except BaseException:
            if file is not None:
                file.close()  # the lock goes with it; a finished run's file is closed by finish()
            raise
        finally:
            bar.close()
        order = [(s.dialogue.id, t) for s in states for t in range(len(s.answers))]
        if file is not None:
            file.finish(order)
        return [records[k] for k in order if k in records]

    def expected_tokens(self, dialogue: Dialogue) -> int:
        """What answering ``dialogue`` costs on the KV path, known before answering it (to
        balance data-parallel ranks): its encoded length, every question and image once,
        the reference answers standing in for the model's, each at most ``max_new_tokens``."""
        encoded = self.adapter.encode_dialogue(dialogue, system_prompt=self.config.system_prompt)
        total = sum(len(c) for c in [*encoded.prefix, *encoded.suffix])
        for turn in encoded.turns:
            total += min(turn.length, self.config.max_new_tokens) if turn.role == "assistant" else turn.length
        return total

    def usage(self) -> Optional[dict[str, Any]]:
        """What the last :meth:`generate` paid an endpoint: nothing for a local model."""
        return None

    def _settings(self, run_key: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        from mmtune.evaluation.generation.fingerprint import weights_fingerprint

        keys = ("max_new_tokens", "do_sample", "temperature", "top_p", "repetition_penalty", "seed", "overflow", "min_new_tokens", "system_prompt")
        settings = {k: getattr(self.config, k) for k in keys}
        settings["context_length"] = self.context_length
        settings["weights"] = weights_fingerprint(self.model)
        settings.update(run_key or {})
        return settings

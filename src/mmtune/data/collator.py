"""The multi-image conversation collator: encoded examples -> one model-ready batch.

Batches are dicts with fixed keys, the image inputs and the position-id layout being the
adapter's (:mod:`mmtune.models.base`, "The batch")::

    input_ids        [B, L] long   token ids; an image is a run of image_token_id
    labels           [B, L] long   -100 everywhere except assistant content + end-of-turn
    attention_mask   [B, L] long   1 real / 0 pad; ``None`` for packed batches (below)
    position_ids     [B, L] long   0.. per sample; restarts at 0 for every packed sample.
                     Adapters with several rows per token (M-RoPE) get ``[1 + rows, B, L]``:
                     the plain running position first, then each sample's own rows
    <image inputs>   one entry per name of ``adapter.image_input_names``, the images of
                     every sample joined in the order of their token runs, row-major, as the
                     adapter declares per input (``adapter.image_input_joins``: concatenated
                     along an axis or stacked, padded); ``None`` when the batch has no image. LLaVA-1.5 and
                     XComposer2: ``pixel_values [N_img, 3, H, W]`` float; Qwen2-VL:
                     ``pixel_values [sum of patches, D]`` and ``image_grid_thw [N_img, 3]``
    <token inputs>   [B, L] what ``adapter.token_inputs(input_ids)`` gives (Gemma 3 through the
                     ``auto`` family: ``token_type_ids``, 1 on image tokens); none by default
    num_loss_tokens  long scalar   count of labels != -100 (for token-weighted losses)

(:data:`BATCH_KEYS` is that list for a family whose only image input is ``pixel_values``;
:func:`batch_keys` gives it for any adapter.)

**Packed batches** put several samples in one row. Their ``attention_mask`` is ``None``:
transformers then reads sample boundaries from ``position_ids`` (every place where the
position does not increase by one starts a new sample; with M-RoPE, from the plain row 0)
and builds a block-diagonal causal mask for SDPA / eager
(``masking_utils.find_packed_sequence_indices``), and flash-attention 2 derives
``cu_seqlens`` from the same ``position_ids``. The training loop runs SDPA and eager per
sample instead (:mod:`mmtune.training.packed_attention`): the same boundaries, no
``L x L`` mask, each sample's own attention cost. A 2-D all-ones mask would switch that
detection off and let samples attend to each other, so none is passed. Row padding
forms its own run of positions 0, 1, ... with pad ids and labels -100: it attends only to
itself and never to a sample. The first label of every packed sample is -100, so the last
token of one sample never learns to predict the next sample's first token (the same
target the unpacked sample never sees).

Run the model with :func:`model_inputs`, which also passes ``use_cache=False``: with a
KV cache object present transformers skips packed-sequence detection (training never
needs the cache anyway).

Example::

    collate = MultiImageCollator(pad_token_id=tok.pad_token_id, adapter=adapter)
    batch = collate([example_a, example_b])
    loss = model(**model_inputs(batch)).loss
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from mmtune.data.encoding import TRAIN_ON, Example, encode_example
from mmtune.data.images import CorruptImageError, ImagePipeline
from mmtune.data.keys import record_key
from mmtune.data.truncation import STRATEGIES, TruncationStats
from mmtune.core.encoded import IGNORE_INDEX

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.dialogue import Dialogue
    from mmtune.models.base import ModelAdapter

__all__ = ["BATCHING_MODES", "BATCH_KEYS", "CollatorConfig", "MultiImageCollator", "MultiImageDataset", "SkippedSample",
           "batch_keys", "forward_inputs", "model_inputs"]

BATCHING_MODES = ("padding", "length_grouped", "token_budget", "packing")
PLAN_MODES = ("auto", "whole", "windowed")
#: ``collator.plan=auto`` plans window by window above this many samples in an epoch
AUTO_WINDOWED_SAMPLES = 50_000
_TEXT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")
#: keys of the batches of a family whose only image input is ``pixel_values``
BATCH_KEYS = (*_TEXT_KEYS, "pixel_values", "num_loss_tokens")
# what a batch holds beside the forward's inputs
_NOT_INPUTS = ("labels", "num_loss_tokens")


def batch_keys(image_input_names: Sequence[str] = ("pixel_values",)) -> tuple[str, ...]:
    """The keys of a batch whose images become the inputs ``image_input_names`` (the adapter's)."""
    return (*_TEXT_KEYS, *image_input_names, "num_loss_tokens")


def forward_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The entries of a collated batch that the model's forward takes (everything but
    ``labels`` and ``num_loss_tokens``), ``None`` ones included: whatever the adapter's
    image inputs and position layout are, they pass through by name."""
    return {k: v for k, v in batch.items() if k not in _NOT_INPUTS}


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for the model's forward from a collated batch.

    Drops ``num_loss_tokens`` and the image inputs of a text-only batch (``None``), and
    sets ``use_cache=False``: a KV cache would turn off transformers' detection of packed
    samples from ``position_ids`` (and training does not need one).
    """
    inputs = {k: v for k, v in batch.items() if k != "num_loss_tokens"}
    for key in [k for k, v in inputs.items() if v is None and k not in _TEXT_KEYS]:
        inputs.pop(key)
    inputs["use_cache"] = False
    return inputs


@dataclass
class CollatorConfig:
    """The ``collator/`` config group: encoding, truncation, batching and the image cache."""

    max_length: int = 4096
    """Token budget per sample (image tokens included); also the row length when packing."""
    truncation: str = "drop_trailing_turns"
    """Over-long samples: ``drop_trailing_turns`` (whole exchanges; skip if the first alone is
    too long), ``skip_sample`` or ``error``."""
    train_on: str = "all_assistant"
    """Labelled turns: ``all_assistant`` or ``last_assistant``."""
    system_prompt: Optional[str] = None
    """Replaces the template's default system prompt; ``""`` = none; null = template default."""
    batching: str = "padding"
    """``padding`` (fixed batch size, pad to longest), ``length_grouped`` (HF-style megabatch
    sort: less padding), ``token_budget`` (batches up to ``max_tokens_per_batch``) or
    ``packing`` (several samples per row of ``max_length``)."""
    batch_size: int = 1
    """Samples per batch (padding / length_grouped), rows per batch (packing)."""
    max_tokens_per_batch: Optional[int] = None
    """token_budget: cap on padded tokens (rows x longest) per batch; null = batch_size x max_length."""
    max_images_per_batch: Optional[int] = None
    """Cap on images per batch (vision-tower memory); null = no cap."""
    megabatch_mult: int = 50
    """length_grouped: megabatch = batch_size x this; sorted by length inside (as transformers)."""
    packing_window: int = 512
    """packing: samples packed together (first-fit-decreasing or minimum bin slack, whichever
    needs fewer rows); larger packs tighter, smaller keeps the sample order closer to the
    sampler's."""
    pad_to_multiple_of: Optional[int] = None
    """Pad the sequence length to a multiple of this (e.g. 8 for tensor cores); null = off."""
    drop_last: bool = False
    """Drop the plan's last batch when it has fewer than ``batch_size`` samples (padding,
    length_grouped) or rows (packing); token_budget batches have no fixed size."""
    image_cache_dir: Optional[str] = None
    """Directory of the processed-pixel cache; null disables it."""
    image_cache_key: str = "content"
    """Pixel-cache key: ``content`` (file bytes hash) or ``stat`` (path, size, mtime)."""
    image_errors: Optional[str] = None
    """An image that fails to decode while training: ``strict`` stops (naming file,
    dialogue and turn); ``skip`` drops the sample, counts it and reports it at the end
    of training and in ``data_report.json``. ``null`` (default): follow
    ``data.validation.mode``, so one setting decides for every bad record."""
    plan: str = "auto"
    """How an epoch's batch plan is built. ``whole``: every sample's length is measured before
    step 1 (the schedule may follow the epoch's step count). ``windowed``: window by window as
    training goes, so step 1 waits for one window; needs ``training.max_steps`` (see
    :mod:`mmtune.data.windowed`). ``auto`` (default): windowed where it can be and the epoch
    holds over 50,000 samples (``training.max_steps`` set, batching not length_grouped,
    truncation not ``error``), else whole."""
    length_cache_dir: Optional[str] = None
    """Directory of the per-sample length cache. ``null`` (default): ``lengths/`` under the
    data cache (``data.cache_dir``), so a second launch reads the lengths back without any
    setting; a record whose image changed under the same path is measured again."""

    def validate(self) -> None:
        """Raise one ValueError listing every invalid field."""
        problems = []
        if self.max_length <= 0:
            problems.append(f"collator.max_length must be > 0 (got {self.max_length})")
        if self.truncation not in STRATEGIES:
            problems.append(f"collator.truncation={self.truncation!r}: use one of {list(STRATEGIES)}")
        if self.train_on not in TRAIN_ON:
            problems.append(f"collator.train_on={self.train_on!r}: use one of {list(TRAIN_ON)}")
        if self.batching not in BATCHING_MODES:
            problems.append(f"collator.batching={self.batching!r}: use one of {list(BATCHING_MODES)}")
        if self.batch_size <= 0:
            problems.append(f"collator.batch_size must be > 0 (got {self.batch_size})")
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch < self.max_length:
            problems.append(
                f"collator.max_tokens_per_batch={self.max_tokens_per_batch} is below collator.max_length="
                f"{self.max_length}: the longest sample could never be batched"
            )
        if self.max_images_per_batch is not None and self.max_images_per_batch <= 0:
            problems.append(f"collator.max_images_per_batch must be > 0 or null (got {self.max_images_per_batch})")
        if self.megabatch_mult <= 0 or self.packing_window <= 0:
            problems.append("collator.megabatch_mult and collator.packing_window must be > 0")
        if self.image_cache_key not in ("content", "stat"):
            problems.append(f"collator.image_cache_key={self.image_cache_key!r}: use 'content' or 'stat'")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            problems.append(f"collator.pad_to_multiple_of must be >= 1 or null (got {self.pad_to_multiple_of})")
        if self.plan not in PLAN_MODES:
            problems.append(f"collator.plan={self.plan!r}: use one of {list(PLAN_MODES)}")
        if self.image_errors not in (None, "strict", "skip"):
            problems.append(f"collator.image_errors={self.image_errors!r}: use 'strict' or 'skip'")
        if problems:
            raise ValueError("invalid collator config:\n  - " + "\n  - ".join(problems))


class MultiImageCollator:
    """Pure collate function: a list of :class:`Example` -> a batch dict (see module doc).

    Args:
        pad_token_id: id used for padding (labels there are -100).
        packed: group examples into rows by ``Example.row`` (set by packing plans).
        pad_to_multiple_of: round the padded length up to a multiple of this.
        image_pipeline: loads pixels for examples whose images are not loaded yet (a
            dataset normally loads them in its worker already) and finishes cached ones.
        adapter: the model adapter, for its image inputs and position-id layout; default:
            the image pipeline's, else a family whose only image input is ``pixel_values``
            with one position row (examples must then carry their ``pixel_values``).
    """

    def __init__(
        self,
        pad_token_id: int,
        *,
        packed: bool = False,
        pad_to_multiple_of: int | None = None,
        image_pipeline: ImagePipeline | None = None,
        adapter: "ModelAdapter | None" = None,
    ):
        self.pad_token_id = int(pad_token_id)
        self.packed = packed
        self.pad_to_multiple_of = pad_to_multiple_of
        self.image_pipeline = image_pipeline
        self.adapter = adapter if adapter is not None else getattr(image_pipeline, "adapter", None)
        self.image_input_names = tuple(getattr(self.adapter, "image_input_names", ("pixel_values",)))
        self.position_rows = int(getattr(self.adapter, "position_id_rows", 1))
        problem = getattr(self.adapter, "packing_problem", "")
        if packed and problem:
            raise ValueError(f"collator.batching=packing cannot work with this model: {problem}. Set "
                             "collator.batching=padding (or length_grouped, token_budget)")

    def _image_inputs(self, example: Example) -> dict[str, torch.Tensor] | None:
        """The model inputs of one example's images (``None`` without images)."""
        if not example.images:
            return None
        loaded = example.raw_images if example.raw_images is not None else example.pixel_values
        if loaded is not None:
            if len(loaded) != len(example.images):
                raise ValueError(
                    f"dialogue {example.dialogue_id!r}: {len(loaded)} pixel tensors for {len(example.images)} images"
                )
            if example.raw_images is None and loaded.dtype != torch.uint8:
                return {"pixel_values": loaded}  # finished pixel values
            if self.image_pipeline is None:
                raise ValueError(
                    f"dialogue {example.dialogue_id!r} carries images as the pixel cache holds them but the collator "
                    "has no image_pipeline to finish them; pass image_pipeline="
                )
            return self.image_pipeline.inputs(list(loaded))
        if self.image_pipeline is None:
            raise ValueError(
                f"dialogue {example.dialogue_id!r} has images but no pixel_values and the collator has no "
                "image_pipeline; load images in the dataset or pass image_pipeline="
            )
        return self.image_pipeline.load_inputs(example.images, dialogue_id=example.dialogue_id)

    def __call__(self, examples: Sequence[Example | None]) -> dict[str, Any]:
        examples = [e for e in examples if isinstance(e, Example)]
        if not examples:
            raise ValueError("empty batch: every sample of this batch was skipped (see the dataset's skip counters)")
        if self.packed:
            rows: dict[int, list[Example]] = {}
            for example in examples:
                rows.setdefault(example.row if example.row is not None else len(rows), []).append(example)
            grouped = list(rows.values())
        else:
            grouped = [[e] for e in examples]

        lengths = [sum(len(e) for e in row) for row in grouped]
        width = max(lengths)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch_size = len(grouped)
        input_ids = torch.full((batch_size, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((batch_size, width), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((batch_size, width), dtype=torch.long)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        # one sample's own rows (M-RoPE) next to the plain running position
        rows_of = torch.zeros((self.position_rows, batch_size, width), dtype=torch.long) if self.position_rows > 1 else None
        images: list[dict[str, torch.Tensor]] = []
        for r, row in enumerate(grouped):
            start = 0
            for example in row:
                n = len(example)
                if len(example.labels) != n:
                    raise ValueError(
                        f"dialogue {example.dialogue_id!r}: {n} input ids but {len(example.labels)} labels"
                    )
                ids = torch.tensor(example.input_ids, dtype=torch.long)
                input_ids[r, start : start + n] = ids
                labels[r, start : start + n] = torch.tensor(example.labels, dtype=torch.long)
                if self.packed:
                    labels[r, start] = IGNORE_INDEX  # no target across the sample boundary
                position_ids[r, start : start + n] = torch.arange(n)
                attention_mask[r, start : start + n] = 1
                inputs = self._image_inputs(example)
                if inputs is not None:
                    images.append(inputs)
                if rows_of is not None:
                    rows_of[:, r, start : start + n] = self.adapter.position_ids(ids, inputs)
                start += n
            if self.packed and start < width:
                # padding is a sample of its own: a fresh position run, so it attends to itself only
                position_ids[r, start:] = torch.arange(width - start)
                if rows_of is not None:
                    rows_of[:, r, start:] = torch.arange(width - start)
        if rows_of is not None:
            position_ids = self.adapter.model_position_ids(rows_of, position_ids)
        image_inputs: dict[str, Any] = {name: None for name in self.image_input_names}
        if images:
            join = getattr(self.adapter, "join_image_inputs", None)
            if join is not None:  # each input joined as the adapter declares it (it names a missing one)
                image_inputs = join(images)
            else:
                missing = [name for name in self.image_input_names if name not in images[0]]
                if missing:
                    raise ValueError(f"the image inputs {sorted(images[0])} lack {missing}, which the adapter declares")
                image_inputs = {name: torch.cat([one[name] for one in images], dim=0) for name in self.image_input_names}
        token_inputs = getattr(self.adapter, "token_inputs", None)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": None if self.packed else attention_mask,
            "position_ids": position_ids,
            **image_inputs,
            **(token_inputs(input_ids) if token_inputs is not None else {}),
            "num_loss_tokens": (labels != IGNORE_INDEX).sum(),
        }


@dataclass(frozen=True)
class SkippedSample:
    """A sample the dataset left out while loading it (skip mode). Returned in place of
    the example so the reason travels with the batch to the main process, where
    :class:`~mmtune.data.datamodule.CollateWithMeta` puts it into the batch metadata."""

    dialogue_id: str
    source: str
    reason: str
    """Problem code: ``corrupt_image`` (cannot be decoded), ``unsupported_image`` (the image
    processor refuses it)."""
    detail: str


class MultiImageDataset(torch.utils.data.Dataset):
    """Encodes a dialogue and loads its pixels on access (so both run in DataLoader workers).

    Indexing with ``i`` gives sample ``i``; with ``(i, row)`` (what packed batch samplers
    yield) the example's ``row`` is set. Returns ``None`` for a sample that is skipped
    by truncation, and a :class:`SkippedSample` for a corrupt image with ``image_errors:
    skip``; the collator drops both, :attr:`skipped_corrupt` counts the latter (per worker
    process; the batch metadata carries them to the main process).

    Args:
        dialogues: random-access sequence of :class:`~mmtune.data.dialogue.Dialogue`.
        adapter: the model adapter.
        config: collator settings (max_length, truncation, train_on, system_prompt, images).
        image_pipeline: pixel loader; ``None`` builds one from ``config``.
    """

    def __init__(
        self,
        dialogues: Sequence["Dialogue"],
        adapter: "ModelAdapter",
        config: CollatorConfig,
        *,
        image_pipeline: ImagePipeline | None = None,
    ):
        config.validate()
        self.dialogues = dialogues
        self.adapter = adapter
        self.config = config
        self.images = image_pipeline or ImagePipeline(
            adapter, cache_dir=config.image_cache_dir, key=config.image_cache_key
        )
        self.truncation_stats = TruncationStats()
        self.skipped_corrupt = 0

    def __len__(self) -> int:
        return len(self.dialogues)

    def __getitem__(self, key: int | tuple[int, int]) -> Example | None:
        index, row = (key if isinstance(key, tuple) else (key, None))
        dialogue = self.dialogues[index]
        cfg = self.config
        try:
            example = encode_example(
                self.adapter,
                dialogue,
                max_length=cfg.max_length,
                truncation=cfg.truncation,
                train_on=cfg.train_on,
                system_prompt=cfg.system_prompt,
                stats=self.truncation_stats,
            )
        except CorruptImageError as err:  # e.g. an image the processor refuses, found while counting its tokens
            return self._skip(dialogue, err)
        if example is None:
            return None
        try:
            system_first = bool(dialogue.turns) and dialogue.turns[0].role == "system"  # numbering skips it
            images = (self.images.load_images(example.images, dialogue_id=dialogue.id, system_first=system_first)
                      if example.images else None)
        except CorruptImageError as err:
            return self._skip(dialogue, err)
        # The record's unique key (its id unless an earlier record of the source has that id):
        # what sample_ids.jsonl logs, so every record of a file with repeated ids shows once.
        return replace(example, dialogue_id=record_key(dialogue), raw_images=images, row=row)

    def _skip(self, dialogue: "Dialogue", err: CorruptImageError) -> "SkippedSample":
        """The sample left out for an image that cannot be used (skip mode); re-raises otherwise."""
        if self.config.image_errors != "skip":
            raise err
        self.skipped_corrupt += 1
        turn = f" {err.turn_text}" if err.turn is not None else ""
        return SkippedSample(dialogue.id, dialogue.source, err.code, f"{err.path}{turn}: {err.__cause__ or err}")

    def collator(self) -> MultiImageCollator:
        """The collate function matching this dataset's config."""
        return MultiImageCollator(
            self.adapter.tokenizer.pad_token_id
            if self.adapter.tokenizer.pad_token_id is not None
            else self.adapter.tokenizer.eos_token_id,
            packed=self.config.batching == "packing",
            pad_to_multiple_of=self.config.pad_to_multiple_of,
            image_pipeline=self.images,
            adapter=self.adapter,
        )

"""Dialogue -> ``input_ids`` / ``labels`` / image list, with exact labels and safe truncation.

The adapter renders a dialogue into chunks (template tokens, text, images); this module
truncates whole trailing exchanges (:mod:`mmtune.data.truncation`), applies the
``train_on`` choice, and flattens chunks into token lists: an image becomes
``num_tokens`` copies of the adapter's ``image_token_id`` and its path goes to
``Example.images`` in the same order, so images and image-token runs stay one-to-one.

Example::

    adapter = build_adapter(ModelConfig(family="llava"))
    example = encode_example(adapter, dialogue, max_length=8192)
    example.input_ids, example.labels, example.images
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Sequence

from mmtune.data.truncation import TruncationStats, truncate
from mmtune.core.encoded import IGNORE_INDEX, EncodedDialogue, EncodedTurn, ImageChunk, TokenChunk

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mmtune.data.dialogue import Dialogue
    from mmtune.models.base import ModelAdapter

__all__ = [
    "TRAIN_ON",
    "ImageRef",
    "Example",
    "flatten",
    "select_trainable",
    "encode_dialogues",
    "encode_example",
    "encode_examples",
    "render_example",
    "truncate_dialogue",
]

TRAIN_ON = ("all_assistant", "last_assistant")


@dataclass(frozen=True)
class ImageRef:
    """An image of an encoded example: its file, the turn that introduced it and its token count."""

    path: str
    turn: int
    """Index of the turn in ``Dialogue.turns`` (system turn included) holding the image."""
    num_tokens: int


@dataclass
class Example:
    """One encoded sample, ready for the collator.

    ``images[k]`` belongs to the k-th run of ``image_token_id`` in ``input_ids``.
    """

    dialogue_id: str
    input_ids: list[int]
    labels: list[int]
    images: list[ImageRef] = field(default_factory=list)
    dropped_turns: int = 0
    """Turns removed by truncation."""
    pixel_values: "torch.Tensor | None" = None
    """The images' finished ``pixel_values`` ([len(images), 3, H, W] float, for a family whose
    only image input they are), or their stacked raw uint8 pixels that the collator's image
    pipeline finishes."""
    raw_images: "list[torch.Tensor] | None" = None
    """The images as the pixel cache holds them (one tensor per image, shapes may differ),
    loaded by a dataset in its worker; the collator's image pipeline turns them into the
    adapter's image inputs."""
    row: int | None = None
    """Row of a packed batch this sample goes into (set by packing plans)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


def select_trainable(encoded: EncodedDialogue, train_on: str) -> EncodedDialogue:
    """Keep labels only on the last assistant turn when ``train_on="last_assistant"``.

    Applied after truncation, so "last" means the last assistant turn that was kept.
    """
    if train_on not in TRAIN_ON:
        raise ValueError(f"collator.train_on={train_on!r}; use one of {list(TRAIN_ON)}")
    if train_on == "all_assistant":
        return encoded
    last = max((i for i, t in enumerate(encoded.turns) if t.role == "assistant"), default=-1)
    turns = [
        turn
        if i == last
        else EncodedTurn(
            turn.role,
            [replace(c, trainable=False) if isinstance(c, TokenChunk) and c.trainable else c for c in turn.chunks],
        )
        for i, turn in enumerate(encoded.turns)
    ]
    return EncodedDialogue(encoded.dialogue_id, encoded.prefix, turns, encoded.suffix)


def flatten(
    encoded: EncodedDialogue, image_token_id: int, turn_offset: int = 0
) -> tuple[list[int], list[int], list[ImageRef]]:
    """Chunks -> (input_ids, labels, images). ``turn_offset`` maps encoded turns back to
    ``Dialogue.turns`` indices (1 when the dialogue starts with a system turn)."""
    input_ids: list[int] = []
    labels: list[int] = []
    images: list[ImageRef] = []

    def add(chunk, turn_index: int) -> None:
        if isinstance(chunk, ImageChunk):
            input_ids.extend(chunk.token_ids(image_token_id))
            labels.extend([IGNORE_INDEX] * chunk.num_tokens)
            images.append(ImageRef(chunk.image.path, turn_index, chunk.num_tokens))
        else:
            input_ids.extend(chunk.ids)
            labels.extend(chunk.ids if chunk.trainable else [IGNORE_INDEX] * len(chunk.ids))

    for chunk in encoded.prefix:
        add(chunk, -1)
    for index, turn in enumerate(encoded.turns):
        for chunk in turn.chunks:
            add(chunk, index + turn_offset)
    for chunk in encoded.suffix:
        add(chunk, -1)
    return input_ids, labels, images


def truncate_dialogue(
    adapter: "ModelAdapter",
    dialogue: "Dialogue",
    encoded: EncodedDialogue,
    max_length: int,
    truncation: str,
    *,
    system_prompt: str | None,
    stats: TruncationStats | None = None,
) -> EncodedDialogue | None:
    """:func:`~mmtune.data.truncation.truncate` ``encoded`` (the adapter's encoding of ``dialogue``),
    exact for every template.

    An adapter that is not ``prefix_stable`` renders a dialogue whole, and the rendering of a cut
    dialogue is not a cut of the rendering (Qwen3.5's template writes the last answer's thinking
    block only after the last user turn): the cut dialogue is then encoded again, and cut again
    while its own encoding is still over ``max_length``. ``stats`` count the final result once.
    """
    counted = TruncationStats()
    cut = truncate(encoded, max_length, truncation, stats=counted)
    if cut is not None and cut is not encoded and not getattr(adapter, "prefix_stable", True):
        cut, counted = _encode_cut(adapter, dialogue, cut, max_length, truncation, system_prompt), TruncationStats(1)
        if cut is None:
            counted.skipped, counted.skipped_ids = 1, [dialogue.id]
        else:
            counted.truncated = 1
            counted.dropped_turns = len(encoded.turns) - len(cut.turns)
            counted.dropped_images = sum(turn.num_images for turn in encoded.turns[len(cut.turns):])
    if stats is not None:
        stats += counted
    return cut


def _encode_cut(adapter: "ModelAdapter", dialogue: "Dialogue", cut: EncodedDialogue, max_length: int,
                truncation: str, system_prompt: str | None) -> EncodedDialogue | None:
    """The dialogue cut to ``cut``'s exchanges, encoded again; cut and encoded again while its
    own encoding is over ``max_length``. ``None``: not even its first exchange fits."""
    offset = 1 if dialogue.turns and dialogue.turns[0].role == "system" else 0
    while cut is not None:
        again = adapter.encode_dialogue(replace(dialogue, turns=dialogue.turns[: offset + len(cut.turns)]),
                                        system_prompt=system_prompt, train_on="all_assistant")
        cut = truncate(again, max_length, truncation)
        if cut is again:
            return again
    return None


def _finish(
    adapter: "ModelAdapter",
    dialogue: "Dialogue",
    encoded: EncodedDialogue,
    *,
    max_length: int | None,
    truncation: str,
    train_on: str,
    system_prompt: str | None,
    stats: TruncationStats | None,
) -> Example | None:
    full_turns = len(encoded.turns)
    if max_length is not None:
        encoded = truncate_dialogue(adapter, dialogue, encoded, max_length, truncation, system_prompt=system_prompt,
                                    stats=stats)
        if encoded is None:
            return None
    elif stats is not None:
        stats.samples += 1
    encoded = select_trainable(encoded, train_on)
    offset = 1 if dialogue.turns and dialogue.turns[0].role == "system" else 0
    input_ids, labels, images = flatten(encoded, adapter.image_token_id, offset)
    return Example(dialogue.id, input_ids, labels, images, dropped_turns=full_turns - len(encoded.turns))


def encode_example(
    adapter: "ModelAdapter",
    dialogue: "Dialogue",
    *,
    max_length: int | None,
    truncation: str = "drop_trailing_turns",
    train_on: str = "all_assistant",
    system_prompt: str | None = None,
    stats: TruncationStats | None = None,
) -> Example | None:
    """Encode one dialogue for training.

    Args:
        adapter: the model family's adapter (renders the chat template).
        max_length: token budget (image tokens included); ``None`` = no limit.
        truncation: ``drop_trailing_turns`` | ``skip_sample`` | ``error``.
        train_on: ``all_assistant`` (default) or ``last_assistant``.
        system_prompt: overrides the template's default system prompt (``""`` = none).
        stats: truncation counters updated in place.

    Returns:
        The :class:`Example`, or ``None`` when the sample is skipped (counted in ``stats``).
    """
    encoded = adapter.encode_dialogue(dialogue, system_prompt=system_prompt, train_on="all_assistant")
    return _finish(
        adapter, dialogue, encoded, max_length=max_length, truncation=truncation, train_on=train_on,
        system_prompt=system_prompt, stats=stats,
    )


def encode_dialogues(
    adapter: "ModelAdapter",
    dialogues: Sequence["Dialogue"],
    *,
    system_prompt: str | None = None,
    train_on: str = "all_assistant",
) -> list[EncodedDialogue]:
    """Render many dialogues: the adapter's batched ``encode_many`` when it has one (one
    tokenizer call for all text pieces), else ``encode_dialogue`` one by one."""
    encode_many = getattr(adapter, "encode_many", None)
    if encode_many is not None:
        return encode_many(dialogues, system_prompt=system_prompt, train_on=train_on)
    return [adapter.encode_dialogue(d, system_prompt=system_prompt, train_on=train_on) for d in dialogues]


def encode_examples(
    adapter: "ModelAdapter",
    dialogues: Sequence["Dialogue"],
    *,
    max_length: int | None,
    truncation: str = "drop_trailing_turns",
    train_on: str = "all_assistant",
    system_prompt: str | None = None,
    stats: TruncationStats | None = None,
) -> list[Example | None]:
    """:func:`encode_example` for many dialogues, rendered with :func:`encode_dialogues`."""
    encoded_list = encode_dialogues(adapter, dialogues, system_prompt=system_prompt, train_on="all_assistant")
    return [
        _finish(adapter, d, e, max_length=max_length, truncation=truncation, train_on=train_on,
                system_prompt=system_prompt, stats=stats)
        for d, e in zip(dialogues, encoded_list)
    ]


def render_example(example: Example, tokenizer, image_token_id: int) -> str:
    """An encoded example as its token pieces, for reading: pieces separated by spaces,
    each image run as ``[image x N]``, loss-bearing runs between ``«`` and ``»``, and
    newlines / tabs shown escaped. What the model is trained on, token by token."""
    out: list[str] = []
    in_loss = False
    k = 0
    ids, labels = example.input_ids, example.labels
    while k < len(ids):
        labelled = labels[k] != IGNORE_INDEX
        if labelled != in_loss:
            out.append("«" if labelled else "»")
            in_loss = labelled
        if ids[k] == image_token_id:
            end = k
            while end < len(ids) and ids[end] == image_token_id:
                end += 1
            out.append(f"[image x {end - k}]")
            k = end
            continue
        piece = tokenizer.convert_ids_to_tokens(int(ids[k]))
        out.append(piece.replace("\n", "\\n").replace("\t", "\\t"))
        k += 1
    if in_loss:
        out.append("»")
    return " ".join(out).replace("« ", "«").replace(" »", "»")

"""Truncation that only ever drops whole trailing exchanges, never part of an image.

Peer frameworks cut the token sequence at ``max_length`` after image-token expansion, which
splits an image's token run ("Image features and image tokens do not match") or silently
cuts a turn in half. Here truncation works on an :class:`~mmtune.core.encoded.EncodedDialogue`
(turn chunks, images as whole :class:`~mmtune.core.encoded.ImageChunk` objects): it keeps the
longest run of leading user/assistant exchanges that fits, so every kept image keeps all of
its tokens and every dropped image disappears with the turn that introduced it.

Strategies (``CollatorConfig.truncation``):

- ``drop_trailing_turns`` (default): drop whole trailing exchanges; a sample whose first
  exchange alone is too long is skipped (``None``) and counted.
- ``skip_sample``: skip any sample longer than ``max_length``.
- ``error``: raise :class:`SampleTooLongError` naming the dialogue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from mmtune.core.encoded import EncodedDialogue

__all__ = ["STRATEGIES", "SampleTooLongError", "TruncationStats", "fit_turns", "truncate"]

STRATEGIES = ("drop_trailing_turns", "skip_sample", "error")


class SampleTooLongError(ValueError):
    """A dialogue exceeds ``max_length`` under ``truncation: error``."""


@dataclass
class TruncationStats:
    """Counts of what truncation did; merge per-worker stats with ``+=``."""

    samples: int = 0
    """Samples seen."""
    truncated: int = 0
    """Samples kept with trailing exchanges dropped."""
    skipped: int = 0
    """Samples dropped entirely (first exchange alone too long, or ``skip_sample``)."""
    dropped_turns: int = 0
    """Turns removed from truncated samples."""
    dropped_images: int = 0
    """Images removed together with their turns."""
    skipped_ids: list[str] = field(default_factory=list)
    """Ids of the first skipped samples (at most 20), for reports."""

    def __iadd__(self, other: "TruncationStats") -> "TruncationStats":
        self.samples += other.samples
        self.truncated += other.truncated
        self.skipped += other.skipped
        self.dropped_turns += other.dropped_turns
        self.dropped_images += other.dropped_images
        self.skipped_ids = (self.skipped_ids + other.skipped_ids)[:20]
        return self

    def as_dict(self) -> dict[str, int]:
        return {
            "samples": self.samples,
            "truncated": self.truncated,
            "skipped": self.skipped,
            "dropped_turns": self.dropped_turns,
            "dropped_images": self.dropped_images,
        }


def _units(roles: Sequence[str]) -> list[int]:
    """Turn counts of the dialogue's droppable units: (user, assistant) exchanges, and a
    final lone turn (a user turn awaiting generation) as a unit of its own."""
    units = []
    i = 0
    n = len(roles)
    while i < n:
        if roles[i] == "user" and i + 1 < n and roles[i + 1] == "assistant":
            units.append(2)
            i += 2
        else:
            units.append(1)
            i += 1
    return units


def fit_turns(
    dialogue_id: str,
    fixed: int,
    turn_lengths: Sequence[int],
    turn_images: Sequence[int],
    roles: Sequence[str],
    max_length: int,
    strategy: str = "drop_trailing_turns",
    *,
    stats: TruncationStats | None = None,
) -> int | None:
    """The truncation decision on lengths alone: how many leading turns are kept.

    ``fixed`` is the length of the prefix and suffix (always kept). Returns
    ``len(turn_lengths)`` when everything fits and ``None`` when the sample is skipped.
    :func:`truncate` and the length pass (:mod:`mmtune.data.lengths`) both decide here, so
    planned lengths and trained lengths cannot disagree.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"collator.truncation={strategy!r}; use one of {list(STRATEGIES)}")
    if max_length <= 0:
        raise ValueError(f"collator.max_length must be positive, got {max_length}")
    stats = stats if stats is not None else TruncationStats()
    stats.samples += 1
    total = fixed + sum(turn_lengths)
    if total <= max_length:
        return len(turn_lengths)

    def skip() -> None:
        stats.skipped += 1
        if len(stats.skipped_ids) < 20:
            stats.skipped_ids.append(dialogue_id)
        return None

    if strategy == "error":
        raise SampleTooLongError(
            f"dialogue {dialogue_id!r} is {total} tokens (with image tokens), over "
            f"collator.max_length={max_length}; raise collator.max_length or set "
            "collator.truncation to drop_trailing_turns or skip_sample"
        )
    if strategy == "skip_sample":
        return skip()
    kept = 0
    length = fixed
    for size in _units(roles):
        unit_length = sum(turn_lengths[kept : kept + size])
        if length + unit_length > max_length:
            break
        length += unit_length
        kept += size
    if kept == 0:
        return skip()
    stats.truncated += 1
    stats.dropped_turns += len(turn_lengths) - kept
    stats.dropped_images += sum(turn_images[kept:])
    return kept


def truncate(
    encoded: EncodedDialogue,
    max_length: int,
    strategy: str = "drop_trailing_turns",
    *,
    stats: TruncationStats | None = None,
) -> EncodedDialogue | None:
    """Fit ``encoded`` into ``max_length`` tokens by dropping whole trailing exchanges.

    Args:
        encoded: the adapter's rendering of one dialogue.
        max_length: token budget including prefix, suffix and image tokens.
        strategy: one of :data:`STRATEGIES`.
        stats: counters updated in place.

    Returns:
        ``encoded`` itself when it fits, a copy with fewer turns, or ``None`` when the
        sample is skipped.

    Raises:
        SampleTooLongError: ``strategy="error"`` and the sample is too long.
        ValueError: unknown strategy or non-positive ``max_length``.
    """
    fixed = sum(len(c) for c in encoded.prefix) + sum(len(c) for c in encoded.suffix)
    kept = fit_turns(
        encoded.dialogue_id,
        fixed,
        [t.length for t in encoded.turns],
        [t.num_images for t in encoded.turns],
        [t.role for t in encoded.turns],
        max_length,
        strategy,
        stats=stats,
    )
    if kept is None:
        return None
    if kept == len(encoded.turns):
        return encoded
    return EncodedDialogue(encoded.dialogue_id, list(encoded.prefix), list(encoded.turns[:kept]), list(encoded.suffix))

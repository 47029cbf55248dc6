"""The encoded example: a dialogue rendered by a model family's chat template, as token chunks.

An adapter (:mod:`mmtune.models.base`) renders a :class:`~mmtune.core.dialogue.Dialogue`
turn by turn into chunks; ``data/`` flattens them into ``input_ids``, ``labels`` and image
references, truncates whole exchanges and packs samples, without knowing the family.
An image becomes ``num_tokens`` copies of the adapter's ``image_token_id`` (one
:class:`ImageChunk`), so truncation and packing only ever move whole images.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.core.dialogue import Image

__all__ = ["IGNORE_INDEX", "Chunk", "EncodedDialogue", "EncodedTurn", "ImageChunk", "TokenChunk"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TokenChunk:
    """Token ids that go into the sequence as they are.

    ``trainable`` chunks get labels equal to their ids (assistant content and its
    end-of-turn token); all others get ``IGNORE_INDEX``.
    """

    ids: tuple[int, ...]
    trainable: bool = False

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class ImageChunk:
    """One image: ``num_tokens`` copies of the adapter's ``image_token_id``, labels ignored.

    ``ids`` (when set, ``num_tokens == len(ids)``) are the image's tokens as its processor
    expands it, where that is more than one repeated token: InternVL's ``<img>`` + context
    tokens + ``</img>``, Pixtral's rows of ``[IMG]`` separated by ``[IMG_BREAK]``. The tokens
    equal to ``image_token_id`` still take the image's features, in order.
    """

    image: "Image"
    num_tokens: int
    ids: tuple[int, ...] | None = None

    def token_ids(self, image_token_id: int) -> list[int]:
        """The image's tokens in the sequence."""
        return list(self.ids) if self.ids is not None else [image_token_id] * self.num_tokens

    def __len__(self) -> int:
        return self.num_tokens


Chunk = Union[TokenChunk, ImageChunk]


@dataclass
class EncodedTurn:
    """The chunks of one turn, including the template's role header and end-of-turn tokens."""

    role: str
    chunks: list[Chunk]

    @property
    def length(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def num_images(self) -> int:
        return sum(1 for c in self.chunks if isinstance(c, ImageChunk))


@dataclass
class EncodedDialogue:
    """A dialogue rendered by an adapter's chat template.

    ``prefix`` (BOS, system prompt) is never dropped; ``turns`` map one-to-one onto the
    dialogue's non-system turns; ``suffix`` (e.g. a final EOS) is appended after the
    last kept turn. Truncation drops whole trailing user/assistant exchanges.
    """

    dialogue_id: str
    prefix: list[Chunk]
    turns: list[EncodedTurn]
    suffix: list[Chunk] = field(default_factory=list)

    @property
    def length(self) -> int:
        return (
            sum(len(c) for c in self.prefix)
            + sum(t.length for t in self.turns)
            + sum(len(c) for c in self.suffix)
        )

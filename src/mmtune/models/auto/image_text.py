"""Stage 3: each image placeholder replaced by the processor's own text for it, and the tokens.

The text depends only on the image's size (read from the file header), so it is computed once
per size on a blank image; the expanded text is tokenized as the processor tokenizes it.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmtune.core.dialogue import Image
from mmtune.core.images import CorruptImageError
from mmtune.models.auto.errors import UnsupportedImageError, UnsupportedProcessorError
from mmtune.models.auto.render import Span
from mmtune.models.images import oriented_size

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

    from mmtune.core.dialogue import Dialogue

__all__ = ["ImageTextStage", "Tokens"]


@dataclass
class Tokens:
    """The tokens of a dialogue's expanded text and the spans of that text."""

    ids: list[int]
    starts: "np.ndarray"  # first character of each token in the expanded text ((0, 0): added by the tokenizer)
    ends: "np.ndarray"
    cores: dict[int, tuple[int, ...]]  # token position -> the image core's ids spliced in for that placeholder
    spans: list[Span]


def offset_array(pairs: list[tuple[int, int]]) -> "np.ndarray":
    """A tokenizer's offset mapping as an ``[n, 2]`` int64 array."""
    import numpy as np

    flat = np.fromiter(itertools.chain.from_iterable(pairs), dtype=np.int64, count=2 * len(pairs))
    return flat.reshape(-1, 2)



class ImageTextStage:
    """Image text and tokens (mixed into the adapter: needs ``processor``, ``tokenizer``, ``image_token``)."""

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
            return encoding.ids, offset_array(encoding.offsets)
        encoding = self.tokenizer(text, add_special_tokens=add, return_offsets_mapping=True)
        return encoding["input_ids"], offset_array(encoding["offset_mapping"])

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
        
        self.config.image_limits.check_file(path)
        return oriented_size(path)  # header only

    @functools.lru_cache(maxsize=65536)
    def _replacement(self, height: int, width: int) -> str:
        """The text the processor puts in place of an image of this size."""
        from PIL import Image as PILImage

        image = PILImage.new("RGB", (width, height), (127, 127, 127))
        return self._replacements(self._call([image]), [image])[0]

    def _image_text(self, image: Image, dialogue_id: str | None = None, turn: int | None = None,
                    system_first: bool = False, index: int = 0) -> str:
        """The text the processor puts for ``image``, the ``index``-th of its dialogue (the number a
        processor that numbers images writes: :attr:`_index_rule`)."""
        try:
            width, height = self._size(image.path)
        except CorruptImageError:
            raise
        except Exception as err:  # noqa: BLE001 - PIL raises many types
            raise CorruptImageError(image.path, dialogue_id, turn, err, system_first) from err
        try:
            text = self._replacement(height, width)
            return text if self._index_rule is None else self._numbered(text, index, self._index_rule)
        except Exception as err:  # noqa: BLE001 - the processor's refusal, named with the image
            raise UnsupportedImageError(image.path, dialogue_id, turn, f"{type(err).__name__}: {err}",
                                        system_first) from err

    def _expand(self, dialogue: "Dialogue", text: str, spans: list[Span], offset: int) -> tuple[str, list[Span]]:
        """``text`` with every image placeholder replaced by the processor's text for that image,
        and the spans moved to match, each image a span of its own."""
        images = [(t, image) for t, turn in enumerate(dialogue.turns) for image in turn.images]
        pieces: list[str] = []
        out: list[Span] = []
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
                replacement = self._image_text(image, dialogue.id, turn_index, offset == 1, found)
                out.append(Span(length, length + at - cursor, span.turn, span.trainable))
                pieces.append(text[cursor:at])
                length += at - cursor
                out.append(Span(length, length + len(replacement), span.turn, image=image))
                pieces.append(replacement)
                length += len(replacement)
                cursor = at + len(self.image_token)
                found += 1
            out.append(Span(length, length + span.end - cursor, span.turn, span.trainable))
            pieces.append(text[cursor:span.end])
            length += span.end - cursor
        if found != len(images):
            raise UnsupportedProcessorError(
                f"dialogue {dialogue.id!r}: the chat template rendered {found} image placeholders "
                f"({self.image_token!r}) for {len(images)} images; it must render one per image"
            )
        return "".join(pieces), out

    def _tokens(self, dialogue: "Dialogue", text: str, spans: list[Span], offset: int) -> Tokens:
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
            return Tokens(ids, offsets[:, 0], offsets[:, 1], {}, moved)
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
        return Tokens(ids, starts, ends, cores, moved)

    def image_token_count(self, image: Image) -> int:
        """Tokens of the processor's text for the image (its size read from the file header; as the
        first image of a dialogue where the processor numbers images)."""
        return self._count(self._image_text(image))

    @functools.lru_cache(maxsize=65536)
    def _count(self, replacement: str) -> int:
        return len(self.tokenizer(replacement, add_special_tokens=False)["input_ids"])

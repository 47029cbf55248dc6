"""Pieces shared by the model-family files.

``deep_update`` merges ``ModelConfig.architecture`` overrides into a family's tiny
architecture; ``load_dtype_and_attention`` reads the load-time settings every adapter's
``load_model`` accepts and ``build_random_model`` builds a random-weight model;
``state_fingerprint`` hashes what an adapter's ``fingerprint()`` covers.

:class:`PieceText` is the text stage of the families that build their chat
template themselves (LLaVA-1.5, InternLM-XComposer2, the Qwen2-VL family): a dialogue is first rendered into
:class:`Piece` objects (text, fixed ids, images), then the text of many dialogues is
tokenized in one batched call, then the pieces become chunks. ``load_sentencepiece`` and
``sentencepiece_from_fast_tokenizer`` give those families the SentencePiece encoding of
their official code, from ``tokenizer.model`` or rebuilt from ``tokenizer.json``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from mmtune.models.base import EncodedDialogue, EncodedTurn, ImageChunk, TokenChunk

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.core.dialogue import Dialogue
    from mmtune.models.config import ModelConfig

__all__ = [
    "deep_update",
    "load_dtype_and_attention",
    "build_random_model",
    "state_fingerprint",
    "Piece",
    "Plan",
    "iter_pieces",
    "PieceText",
    "find_sentencepiece_model",
    "check_template_words",
    "load_sentencepiece",
    "sentencepiece_from_fast_tokenizer",
]


def deep_update(base: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """A deep copy of ``base`` with ``overrides`` merged in; nested dicts merge key by key."""
    out = copy.deepcopy(base)
    for key, value in (overrides or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_dtype_and_attention(kwargs: dict[str, Any], config: "ModelConfig") -> tuple[Any, str | None]:
    """Pop ``torch_dtype`` (or ``dtype``) and ``attn_implementation`` from ``load_model``'s
    keyword arguments, falling back to the ModelConfig; a dtype name becomes the torch dtype."""
    import torch

    dtype = kwargs.pop("torch_dtype", None) or kwargs.pop("dtype", None) or config.torch_dtype
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    attn = kwargs.pop("attn_implementation", None) or config.attn_implementation
    return dtype, attn


def build_random_model(model_class: Any, model_config: Any, *, seed: int, attn_implementation: Any, dtype: Any):
    """A random-weight ``model_class`` for ``model_config``, initialised from ``seed``.

    The global RNG state is left as it was, so building a model does not shift the data
    order or dropout of a run that seeded torch before.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class._from_config(
            copy.deepcopy(model_config), attn_implementation=attn_implementation, dtype=dtype
        )


def state_fingerprint(state: dict[str, Any]) -> str:
    """A short stable hash of a JSON-able state (key order does not matter)."""
    return hashlib.sha1(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_sentencepiece_model(tokenizer: Any, directory: str | None) -> str | None:
    """The SentencePiece model file behind ``tokenizer``: its ``vocab_file`` when that is a
    ``.model`` file, else ``tokenizer.model`` in the checkpoint ``directory``; ``None`` when
    there is none (byte-level BPE tokenizers, hub ids)."""
    import os

    vocab_file = getattr(tokenizer, "vocab_file", None)
    if isinstance(vocab_file, str) and vocab_file.endswith(".model") and os.path.isfile(vocab_file):
        return vocab_file
    if directory and os.path.isfile(os.path.join(directory, "tokenizer.model")):
        return os.path.join(directory, "tokenizer.model")
    return None


def load_sentencepiece(path: str, tokenizer: Any) -> Any:
    """A ``SentencePieceProcessor`` for ``path``, checked against ``tokenizer``'s vocabulary.

    The official LLaVA-1.5 and XComposer2 training code tokenizes with SentencePiece itself
    (slow tokenizers); converted fast tokenizers differ from it on text that starts with
    spaces (a lost or merged word marker), so text is encoded with this processor. Raises
    ``ValueError`` when the model file and the tokenizer disagree on a piece.
    """
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=path)
    size = processor.get_piece_size()
    probe = sorted({0, 1, 2, size // 3, size // 2, size - 1})
    theirs = tokenizer.convert_ids_to_tokens(probe)
    ours = [processor.id_to_piece(i) for i in probe]
    if theirs != ours:
        raise ValueError(
            f"{path} does not belong to the tokenizer it ships with: ids {probe} are {ours} in the "
            f"SentencePiece model but {theirs} in the tokenizer; use the checkpoint's own tokenizer files"
        )
    return processor


WORD_MARKER = "\u2581"  # SentencePiece's escaped space, "▁"


def sentencepiece_from_fast_tokenizer(tokenizer: Any) -> Any | None:
    """A ``SentencePieceProcessor`` rebuilt from a fast tokenizer converted from a
    SentencePiece BPE model, for checkpoints that ship ``tokenizer.json`` without
    ``tokenizer.model`` (what transformers 5 saves); ``None`` when ``tokenizer`` is not such
    a conversion.

    The Rust tokenizer differs from SentencePiece wherever a space meets a word: its
    ``Metaspace`` step adds no word marker to text that already starts with a space, and its
    merges, kept in vocabulary order, join runs of spaces first (``" and"`` -> ``▁and`` and
    ``"a  b"`` -> ``▁a ▁▁ b``, where SentencePiece gives ``▁ ▁and`` and ``▁a ▁ ▁b``).
    SentencePiece itself needs piece scores, which ``tokenizer.json`` does not keep. They
    are restored from the vocabulary order: a converted BPE vocabulary lists pieces by
    merge priority (checked below against the merges), so scores fall with the id, except
    whitespace-only pieces, which the Llama / Llama-2 model (``tokenizer.model`` as Meta
    publishes it, also Vicuna's and LLaVA-1.5's) scores -1e9, below every merge. Byte
    pieces serve the byte fallback; the dummy prefix is on and whitespace is not folded,
    as in that model. On the Llama-2 tokenizer the rebuilt model encodes exactly as
    ``tokenizer.model`` (a test compares them on generated and real text).
    """
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    model = state.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback") or not _adds_word_marker(state):
        return None
    vocab: dict[str, int] = model["vocab"]
    pieces = sorted(vocab, key=vocab.__getitem__)
    bytes_ = {f"<0x{b:02X}>" for b in range(256)}
    unk = getattr(tokenizer, "unk_token", None)
    if [vocab[p] for p in pieces] != list(range(len(pieces))) or not bytes_ <= vocab.keys() or unk not in vocab:
        return None

    def whitespace_only(piece: str) -> bool:
        return set(piece) == {WORD_MARKER}

    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        merged = vocab.get(left + right)
        if merged is None:
            return None
        if not whitespace_only(left + right):
            if merged < last:  # the vocabulary is not in merge order: no scores to restore
                return None
            last = merged

    import sentencepiece as spm
    from transformers.convert_slow_tokenizer import import_protobuf

    model_pb2 = import_protobuf()
    proto = model_pb2.ModelProto()
    kind = model_pb2.ModelProto.SentencePiece.Type
    control = {t["content"] for t in state.get("added_tokens", []) if t.get("special")}
    for index, piece in enumerate(pieces):
        entry = proto.pieces.add()
        entry.piece = piece
        if piece == unk:
            entry.type = kind.Value("UNKNOWN")
        elif piece in control:
            entry.type = kind.Value("CONTROL")
        elif piece in bytes_:
            entry.type = kind.Value("BYTE")
        else:
            entry.type = kind.Value("NORMAL")
            entry.score = -1e9 if whitespace_only(piece) else -float(index)
    spec = proto.trainer_spec
    spec.model_type = model_pb2.TrainerSpec.ModelType.Value("BPE")
    spec.vocab_size = len(pieces)
    spec.byte_fallback = True
    spec.unk_id = vocab[unk]
    for name in ("bos", "eos", "pad"):
        token = getattr(tokenizer, f"{name}_token", None)
        setattr(spec, f"{name}_id", vocab[token] if token in control and token in vocab else -1)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = True
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _adds_word_marker(state: dict[str, Any]) -> bool:
    """Whether a ``tokenizer.json`` state encodes text the way SentencePiece's dummy prefix
    does: a ``Metaspace`` pre-tokenizer that prepends ``▁`` (transformers 5 conversions) or
    a ``Prepend("▁")`` + ``Replace(" ", "▁")`` normalizer (older ones)."""
    pre = state.get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace" and pre.get("replacement") == WORD_MARKER:
        return pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never") != "never"
    norm = state.get("normalizer") or {}
    steps = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]
    return {"type": "Prepend", "prepend": WORD_MARKER} in steps and any(
        step.get("type") == "Replace" and step.get("content") == WORD_MARKER for step in steps
    )


def check_template_words(tokenizer: Any, words: Sequence[str], where: str | None) -> None:
    """Fail when the tokenizer maps a word of the chat template to its unknown token: the
    template's role names would then be invisible to the model."""
    unk = tokenizer.unk_token_id
    if unk is None:
        return
    lost = [w for w in words if unk in tokenizer(w, add_special_tokens=False)["input_ids"]]
    if lost:
        raise ValueError(
            f"the tokenizer of {where or 'the model'} maps the chat template's words {lost} to the unknown token "
            f"{tokenizer.unk_token!r}; use a tokenizer whose vocabulary covers them (the checkpoint's own tokenizer)"
        )


@dataclass
class Piece:
    """One unit of a rendered dialogue before tokenization: text, fixed ids, or an image.

    ``plain`` tokens at the start of a trainable text piece stay unlabelled (the official
    XComposer2 code labels by position, and its role header shares the answer's piece).
    """

    kind: str  # "text" | "ids" | "image"
    value: Any
    trainable: bool = False
    plain: int = 0


#: a rendered dialogue: prefix pieces, (role, pieces) per non-system turn, suffix pieces
Plan = tuple[list[Piece], list[tuple[str, list[Piece]]], list[Piece]]


def iter_pieces(prefix: list[Piece], rendered: list[tuple[str, list[Piece]]], suffix: list[Piece]) -> Iterator[Piece]:
    """Every piece of a :data:`Plan`, in sequence order."""
    yield from prefix
    for _, pieces in rendered:
        yield from pieces
    yield from suffix


class PieceText(ABC):
    """The text stage of an adapter that renders dialogues into pieces and tokenizes their text in
    batches (mixed into the adapter, before its encoder).

    Subclasses implement :meth:`_pieces` (the chat template) and :meth:`_tokenize_many`
    (how text pieces become ids); each image becomes :meth:`image_token_count` tokens.
    """

    @abstractmethod
    def _pieces(
        self, dialogue: "Dialogue", system_prompt: str | None, train_on: str, add_generation_prompt: bool
    ) -> Plan:
        """Render one dialogue (the arguments as in :meth:`encode_dialogue`)."""

    @abstractmethod
    def _tokenize_many(self, texts: list[str]) -> list[Sequence[int]]:
        """Ids of every text piece, in order, without special tokens added."""

    def encode_many(
        self,
        dialogues: Sequence["Dialogue"],
        *,
        system_prompt: str | None = None,
        train_on: str = "all_assistant",
        add_generation_prompt: bool = False,
    ) -> list[EncodedDialogue]:
        """:meth:`encode_dialogue` for many dialogues with one batched tokenizer call
        (the per-call overhead of the tokenizer dominates for short text pieces)."""
        plans = [self._pieces(d, system_prompt, train_on, add_generation_prompt) for d in dialogues]
        texts = [p.value for plan in plans for p in iter_pieces(*plan) if p.kind == "text"]
        ids_iter = iter(self._tokenize_many(texts))

        def chunks(pieces: list[Piece]) -> list:
            result = []
            for piece in pieces:
                if piece.kind == "text":
                    ids = tuple(next(ids_iter))
                    if piece.trainable and piece.plain:
                        if ids[: piece.plain]:
                            result.append(TokenChunk(ids[: piece.plain], False))
                        ids = ids[piece.plain :]
                    if ids:  # a piece that tokenizes to nothing adds no chunk
                        result.append(TokenChunk(ids, piece.trainable))
                elif piece.kind == "ids":
                    if piece.value:
                        result.append(TokenChunk(tuple(piece.value), piece.trainable))
                else:
                    result.append(ImageChunk(piece.value, self.image_token_count(piece.value)))
            return result

        out = []
        for dialogue, (prefix, rendered, suffix) in zip(dialogues, plans):
            prefix_chunks = chunks(prefix)
            turns = [EncodedTurn(role, chunks(pieces)) for role, pieces in rendered]
            out.append(EncodedDialogue(dialogue.id, prefix_chunks, turns, chunks(suffix)))
        return out

    def measure_many(
        self, dialogues: Sequence["Dialogue"], *, system_prompt: str | None = None
    ) -> list[tuple[int, list[int], list[int], list[str]]]:
        """Lengths only, for the length pass: per dialogue ``(prefix + suffix length, turn
        lengths, images per turn, roles)``, equal to what :meth:`encode_many` gives, without
        building chunk objects (one batched tokenizer call)."""
        plans = [self._pieces(d, system_prompt, "all_assistant", False) for d in dialogues]
        texts = [p.value for plan in plans for p in iter_pieces(*plan) if p.kind == "text"]
        counts = iter([len(ids) for ids in self._tokenize_many(texts)])

        def size(pieces: list[Piece]) -> tuple[int, int]:
            length = images = 0
            for piece in pieces:
                if piece.kind == "text":
                    length += next(counts)
                elif piece.kind == "ids":
                    length += len(piece.value)
                else:
                    length += self.image_token_count(piece.value)
                    images += 1
            return length, images

        out = []
        for prefix, rendered, suffix in plans:
            fixed = size(prefix)[0]  # in sequence order: the text counts are consumed as they come
            sizes = [size(pieces) for _, pieces in rendered]
            fixed += size(suffix)[0]
            out.append((fixed, [n for n, _ in sizes], [k for _, k in sizes], [role for role, _ in rendered]))
        return out

    def encode_dialogue(
        self,
        dialogue: "Dialogue",
        *,
        system_prompt: str | None = None,
        train_on: str = "all_assistant",
        add_generation_prompt: bool = False,
    ) -> EncodedDialogue:
        """:meth:`encode_many` of one dialogue (see the subclass for its system prompt rules)."""
        return self.encode_many(
            [dialogue], system_prompt=system_prompt, train_on=train_on, add_generation_prompt=add_generation_prompt
        )[0]

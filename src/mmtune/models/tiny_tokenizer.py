"""A small byte-level BPE tokenizer for random-weight test and demo models.

There is no model hub here, so tiny models cannot download a tokenizer. Byte-level BPE
round-trips any text exactly (so label spans decode back to the assistant text), and a
few hundred merges learned from a fixed corpus keep the demo's sequences short. The
result is deterministic: the same corpus and vocabulary size give the same ids.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Words the synthetic data and the templates use; extra text is encoded byte by byte.
_BASE_CORPUS = (
    "USER: ASSISTANT: A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions. "
    "Image1 Image2 Image3 Image4 Image5 Image6 Image7 Image8 Image9 Image10 "
    "What colour is the shape in Image? What shape is shown in Image? Which image shows "
    "Compare the two images. Do they have the same colour? the same shape? Yes No "
    "red green blue yellow purple orange white black cyan magenta gray brown "
    "square circle triangle cross stripes dots "
    "The shape in is a It is The first image second image both neither "
    "user assistant system Describe the image. Answer with one word. "
    "0 1 2 3 4 5 6 7 8 9 10 . , ? ! : ; ' \" ( ) \n"
)


def build_tiny_tokenizer(
    special_tokens: Sequence[str],
    *,
    vocab_size: int = 512,
    extra_corpus: Iterable[str] = (),
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on the built-in corpus (plus ``extra_corpus``).

    Args:
        special_tokens: added first, in order, so their ids are ``0..len-1``; each is
            never split and never produced from plain text.
        vocab_size: total vocabulary size including the 256 byte tokens and specials.

    Returns:
        A ``PreTrainedTokenizerFast`` with the given special tokens set.
    """
    backend = _train(tuple(special_tokens), vocab_size, tuple(extra_corpus))
    return _wrap(backend, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token)


def cached_tiny_tokenizer(
    special_tokens: tuple[str, ...],
    *,
    vocab_size: int = 512,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """:func:`build_tiny_tokenizer` (no extra corpus) with ``chat_template`` set: a new
    tokenizer object on every call, from a memoized training run.

    The training run is kept as the backend's JSON, which nothing can change, so every
    adapter of a process gets the same ids without training again; the tokenizer object
    is never shared, so what one run sets on its tokenizer (``model_max_length`` by
    context extension, added tokens, a chat template) cannot reach an adapter built later
    in the same process.
    """
    backend = Tokenizer.from_str(_trained_json(tuple(special_tokens), vocab_size))
    tokenizer = _wrap(backend, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _train(special_tokens: tuple[str, ...], vocab_size: int, extra_corpus: tuple[str, ...]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [_BASE_CORPUS] * 4 + list(extra_corpus)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


@functools.lru_cache(maxsize=8)
def _trained_json(special_tokens: tuple[str, ...], vocab_size: int) -> str:
    return _train(special_tokens, vocab_size, ()).to_str()


def _wrap(backend: Tokenizer, **special: str | None) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **special)

"""The one tiny tokenizer builder: byte-level BPEs trained on a fixed corpus, for random-weight
test and demo models.

There is no model hub here, so tiny models cannot download a tokenizer. Byte-level BPE
round-trips any text exactly (so label spans decode back to the assistant text), and a few
hundred merges learned from a fixed corpus keep sequences short. Every result is
deterministic: the same corpus, split and vocabulary size give the same ids.

:func:`trained_bpe` is the training run (memoized); the tokenizers of the families are views
of it: :func:`cached_tiny_tokenizer` (LLaVA-1.5, InternLM-XComposer2 with ``model.path=null``),
:func:`qwen_tokenizer` (Qwen2-VL family, Qwen's split) and :func:`class_tokenizer`
(the ``auto`` family's tiny checkpoints: Qwen's merges behind a plain byte-level split, with a
class's special tokens).
"""

from __future__ import annotations

import functools
import json
from typing import Sequence

__all__ = ["BASE_CORPUS", "QWEN_CORPUS", "cached_tiny_tokenizer", "class_tokenizer", "qwen_tokenizer", "trained_bpe"]

# Words the synthetic data and the templates use; extra text is encoded byte by byte.
BASE_CORPUS = (
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
_BASE_CORPUS = BASE_CORPUS  # the name tests of the LLaVA tokenizer import

# Words the templates and the tests use, repeated so that BPE learns them as single tokens
# (the official label rule counts the role name as one token: "assistant" is id 77091 in the
# released vocabulary).
QWEN_CORPUS = (
    "system\nYou are a helpful assistant.\nuser\nassistant\n"
    "user user user assistant assistant assistant system system\n"
    "Image1: Image2: Image3: What is shown in the image? Describe the picture. Compare the two images.\n"
    "The first image is red, the second image is green. Which one is larger? Yes. No. It is a cat.\n"
    "0 1 2 3 4 5 6 7 8 9 10 . , ? ! : ; ' \" ( ) \n\n"
)

#: corpus name -> (text, repeats)
_CORPORA = {"base": (BASE_CORPUS, 4), "qwen": (QWEN_CORPUS, 16)}


@functools.lru_cache(maxsize=16)
def trained_bpe(corpus: str, vocab_size: int, special_tokens: tuple[str, ...] = ()) -> str:
    """The JSON of a byte-level BPE trained on corpus ``"base"`` (byte-level split, the
    ``special_tokens`` first at ids ``0..n-1``) or ``"qwen"`` (the pipeline transformers'
    ``Qwen2Tokenizer`` installs: NFC, Qwen's split regex, byte level; no special tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    text, repeats = _CORPORA[corpus]
    tokenizer = Tokenizer(models.BPE())
    if corpus == "qwen":
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([text] * repeats, trainer=trainer)
    return tokenizer.to_str()


def _vocab_and_merges(corpus: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(trained_bpe(corpus, vocab_size))["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), merges


def cached_tiny_tokenizer(
    special_tokens: tuple[str, ...],
    *,
    vocab_size: int = 512,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    chat_template: str | None = None,
):
    """The ``base`` BPE with ``special_tokens`` at ids ``0..n-1`` and ``chat_template`` set: a new
    tokenizer object on every call, from the memoized training run.

    The tokenizer object is never shared, so what one run sets on its tokenizer
    (``model_max_length`` by context extension, added tokens, a chat template) cannot reach an
    adapter built later in the same process.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(trained_bpe("base", vocab_size, tuple(special_tokens)))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                        bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                                        unk_token=unk_token)  # fmt: skip
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def qwen_tokenizer(special_tokens: Sequence[str], *, vocab_size: int = 512, eos_token: str, pad_token: str):
    """A ``Qwen2Tokenizer`` over the ``qwen`` BPE, plus ``special_tokens`` (added after the vocabulary,
    as in the released Qwen vocabularies); no BOS, no unk. A fresh object each call."""
    from tokenizers import AddedToken
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    vocab, merges = _vocab_and_merges("qwen", vocab_size)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=None, pad_token=None,
        clean_up_tokenization_spaces=False,
    )  # fmt: skip
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens], special_tokens=True)
    tokenizer.eos_token = eos_token
    tokenizer.pad_token = pad_token
    return tokenizer


def class_tokenizer(special_tokens: Sequence[str], *, bos: str | None, eos: str, pad: str,
                    named_tokens: dict[str, str] | None = None, add_bos: bool = True):
    """A fast tokenizer over the ``qwen`` BPE's merges with a byte-level split and
    ``special_tokens``; BOS added by the tokenizer (as the released Llama / Gemma / Mistral
    tokenizers do) where ``bos`` is set and ``add_bos``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab, merges = _vocab_and_merges("qwen", 512)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    if bos is not None and add_bos:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, pad_token=pad,
        extra_special_tokens=dict(named_tokens or {}) or None, clean_up_tokenization_spaces=False,
    )  # fmt: skip

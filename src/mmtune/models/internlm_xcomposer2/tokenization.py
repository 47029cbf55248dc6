"""InternLM2's tokenizer without remote code, and how a checkpoint's tokenizer is found.
"""

from __future__ import annotations

import os
from typing import Any

from transformers.tokenization_utils_sentencepiece import SentencePieceBackend


__all__ = [
    "InternLM2Tokenizer",
    "load_tokenizer",
]


class InternLM2Tokenizer(SentencePieceBackend):
    """InternLM2's tokenizer without remote code: SentencePiece's own encoding of
    ``tokenizer.model`` (BPE with byte fallback and no dummy prefix), as the official slow
    tokenizer encodes. Converted fast tokenizers and ``LlamaTokenizer`` put a word marker
    ("▁") before separately encoded text, which changes role headers and answer starts.

    ``add_bos_token`` (default on) prepends ``<s>`` when ``add_special_tokens=True``;
    decoding goes through SentencePiece, so byte-fallback pieces become characters again.
    """

    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        unk_token: str = "<unk>",
        bos_token: str = "<s>",
        eos_token: str = "</s>",
        pad_token: str = "</s>",
        add_bos_token: bool = True,
        add_eos_token: bool = False,
        **kwargs: Any,
    ):
        for key in ("legacy", "special_tokens_pattern", "auto_map", "tokenizer_class"):
            kwargs.pop(key, None)
        pattern = {(True, False): "bos", (False, True): "eos", (True, True): "bos_eos"}.get(
            (bool(add_bos_token), bool(add_eos_token)), "none"
        )
        super().__init__(
            vocab_file=vocab_file, unk_token=unk_token, bos_token=bos_token, eos_token=eos_token,
            pad_token=pad_token, legacy=True, special_tokens_pattern=pattern, **kwargs,
        )  # fmt: skip
        self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
        self.init_kwargs.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp_model.decode_pieces(list(tokens))

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """SentencePiece ids of each text, no special tokens added (one batched call).
        Control-token strings in the text stay plain text; ``[UNUSED_TOKEN_*]`` strings are
        pieces of the model and become those tokens, as in the official tokenizer."""
        return self.sp_model.encode(list(texts)) if texts else []


def load_tokenizer(path: str, trust_remote_code: bool):
    """The checkpoint's tokenizer without running its code where possible.

    Order: with ``trust_remote_code``, the checkpoint's own ``AutoTokenizer``; otherwise
    :class:`InternLM2Tokenizer` on its ``tokenizer.model`` (an official directory ships only
    that and remote code; a converted one the same file), then a fast ``tokenizer.json``.
    """
    from transformers import AutoTokenizer

    errors = []
    if trust_remote_code:
        try:
            return AutoTokenizer.from_pretrained(path, use_fast=False, trust_remote_code=True)
        except Exception as err:  # noqa: BLE001 - every failure is reported below
            errors.append(f"AutoTokenizer (remote code): {type(err).__name__}: {err}")
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
        try:
            return InternLM2Tokenizer.from_pretrained(path)
        except Exception as err:  # noqa: BLE001
            errors.append(f"InternLM2Tokenizer(tokenizer.model): {type(err).__name__}: {err}")
    else:
        errors.append(f"no tokenizer.model in {path}")
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=True)
    except Exception as err:  # noqa: BLE001
        errors.append(f"AutoTokenizer: {type(err).__name__}: {err}")
    raise ValueError(
        f"cannot load the tokenizer of {path}:\n  " + "\n  ".join(errors) + "\n  An official InternLM-XComposer2 "
        "directory has the SentencePiece file tokenizer.model; copy it next to the weights (the sentencepiece and "
        "protobuf packages are mmtune dependencies)."
    )

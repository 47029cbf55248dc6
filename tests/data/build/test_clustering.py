import numpy as np
import pytest

from mmtune.data.build.clustering import (
    cluster_embeddings, communities, neighbours_blocked, neighbours_faiss, size_histogram,
)
from mmtune.data.build.config import ClusterConfig


def _planted(n_clusters=5, per=7, dim=32, noise=0.15, n_noise=6, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_clusters, dim))
    rows, labels = [], []
    for c in range(n_clusters):
        for _ in range(per):
            rows.append(centres[c] + noise * np.linalg.norm(centres[c]) / np.sqrt(dim) * rng.normal(size=dim))
            labels.append(c)
    for _ in range(n_noise):
        rows.append(rng.normal(size=dim))
        labels.append(-1)
    x = np.asarray(rows, dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True), np.array(labels)


def test_planted_clusters_are_found_and_noise_left_out():
    x, labels = _planted()
    clusters, backend = cluster_embeddings(x, ClusterConfig(threshold=0.75, min_size=2, block_size=8, index="blocked"))
    assert backend == "blocked"
    assert sorted(sorted(labels[c].tolist()) for c in clusters) == [[k] * 7 for k in range(5)]
    flat = [i for c in clusters for i in c]
    assert len(flat) == len(set(flat))
    # every member is within the threshold of its cluster's seed
    for c in clusters:
        assert (x[c] @ x[c[0]]).min() >= 0.75


def test_threshold_and_min_size_control_clusters():
    x, _ = _planted()
    assert cluster_embeddings(x, ClusterConfig(threshold=0.999, index="blocked"))[0] == []
    assert cluster_embeddings(x, ClusterConfig(threshold=0.75, min_size=8, index="blocked"))[0] == []


def test_blocked_neighbours_match_brute_force_for_any_block_size():
    x, _ = _planted(seed=3)
    sims = x @ x.T
    for block in (1, 5, 64):
        nb = neighbours_blocked(x, k=4, threshold=-1.0, block_size=block)
        np.testing.assert_allclose(nb.score, -np.sort(-sims, axis=1)[:, :4], rtol=1e-5, atol=1e-6)


def test_max_neighbors_caps_cluster_size():
    x, _ = _planted(n_clusters=1, per=20, n_noise=0)
    clusters, _ = cluster_embeddings(x, ClusterConfig(threshold=0.5, max_neighbors=5, index="blocked"))
    sizes = [len(c) for c in clusters]
    assert max(sizes) == 6 and min(sizes) >= 2  # a seed plus at most 5 neighbours
    flat = [i for c in clusters for i in c]
    assert len(flat) == len(set(flat))


def test_faiss_flat_matches_blocked_and_ivf_runs():
    pytest.importorskip("faiss")
    x, labels = _planted(seed=1)
    cfg = ClusterConfig(threshold=0.75, index="faiss")
    faiss_clusters, backend = cluster_embeddings(x, cfg)
    assert backend == "faiss"
    blocked = cluster_embeddings(x, ClusterConfig(threshold=0.75, index="blocked"))[0]
    assert sorted(map(sorted, faiss_clusters)) == sorted(map(sorted, blocked))
    nb = neighbours_faiss(x, k=8, threshold=0.75, ivf_min=10, nprobe=64)  # IVF; all lists probed = exact
    found = communities(nb, 2)
    assert sorted(sorted(labels[c].tolist()) for c in found) == [[k] * 7 for k in range(5)]


def test_auto_uses_faiss_only_above_the_size_threshold():
    pytest.importorskip("faiss")
    x, _ = _planted()
    assert cluster_embeddings(x, ClusterConfig(index="auto", faiss_min_entries=10_000))[1] == "blocked"
    assert cluster_embeddings(x, ClusterConfig(index="auto", faiss_min_entries=10))[1] == "faiss"


def test_size_histogram_buckets():
    assert size_histogram([[0, 1], [0, 1, 2], [0] * 4, [0] * 5, [0] * 17]) == {"2": 1, "3-4": 2, "5-8": 1, "17-32": 1}


def test_blocked_neighbours_above_threshold_match_brute_force_on_both_paths():
    x, _ = _planted(seed=4)
    sims = x @ x.T
    expect = -np.sort(-sims, axis=1)[:, :6]
    expect = np.where(expect >= 0.5, expect, -np.inf)
    for k, block in ((6, 7), (6, 1000)):  # sparse path (few pairs pass) and the top-k fallback
        nb = neighbours_blocked(x, k=k, threshold=0.5, block_size=block)
        np.testing.assert_allclose(nb.score, expect, rtol=1e-5, atol=1e-6)
        assert ((nb.index >= 0) == np.isfinite(expect)).all()
    dense = neighbours_blocked(x, k=2, threshold=-1.0, block_size=7)  # everything passes: fallback
    np.testing.assert_allclose(dense.score, -np.sort(-sims, axis=1)[:, :2], rtol=1e-5, atol=1e-6)

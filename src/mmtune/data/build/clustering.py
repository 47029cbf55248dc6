"""Threshold clustering of unit embeddings by cosine similarity.

Single-link grouping (connected components above a threshold) chains unrelated
entries into one giant cluster on real corpora, so clusters here are *communities*:
every entry's neighbours above the threshold (at most ``max_neighbors``, itself
included) form a candidate; candidates are taken largest first, each keeping only
entries no earlier cluster took, and kept when at least ``min_size`` remain. Every
member of a cluster is thus within the threshold of the cluster's seed entry.

The neighbour search is the expensive part and has two back-ends:

- ``blocked``: exact, numpy matrix products over blocks of ``block_size`` rows, keeping
  only the top-k per row. O(n^2 d) work, O(block_size * n) memory; fine up to about a
  million entries on a multi-core CPU.
- ``faiss``: a faiss inner-product index: exact (flat) below ``faiss_ivf_min`` entries,
  IVF (approximate, sub-quadratic) above.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from mmtune.data.build.config import ClusterConfig

log = logging.getLogger(__name__)


@dataclass
class Neighbours:
    """Top-k neighbours of every row above the threshold: ``index[i, j] = -1`` pads."""

    index: np.ndarray
    """(n, k) int64, sorted by decreasing similarity; the row itself is included."""
    score: np.ndarray
    """(n, k) float32 similarities (``-inf`` where padded)."""


def _keep_above(index: np.ndarray, score: np.ndarray, threshold: float) -> Neighbours:
    mask = score >= threshold
    index = np.where(mask, index, -1).astype(np.int64)
    score = np.where(mask, score, -np.inf).astype(np.float32)
    return Neighbours(index, score)


def neighbours_blocked(emb: np.ndarray, k: int, threshold: float, block_size: int = 2048) -> Neighbours:
    """Exact top-k cosine neighbours above ``threshold``, by blocks of rows (rows must be unit length).

    Most pairs of a real corpus are far below the threshold, so each block keeps only the
    pairs above it and sorts those; a block where too many pass (a low threshold, a
    near-duplicate corpus) takes a per-row top-k partition instead, bounding memory.
    """
    n = emb.shape[0]
    k = min(k, n)
    out_i = np.full((n, k), -1, dtype=np.int64)
    out_s = np.full((n, k), -np.inf, dtype=np.float32)
    for start in range(0, n, block_size):
        sims = emb[start : start + block_size] @ emb.T  # (b, n)
        b = sims.shape[0]
        rows, cols = np.nonzero(sims >= threshold)
        if rows.size <= 8 * b * k:
            vals = sims[rows, cols]
            order = np.lexsort((cols, -vals, rows))  # by row, then similarity descending
            rows, cols, vals = rows[order], cols[order], vals[order]
            rank = np.arange(rows.size) - np.searchsorted(rows, rows, side="left")
            keep = rank < k
            out_i[start + rows[keep], rank[keep]] = cols[keep]
            out_s[start + rows[keep], rank[keep]] = vals[keep]
            continue
        part = np.argpartition(-sims, k - 1, axis=1)[:, :k] if k < n else np.broadcast_to(np.arange(n), sims.shape)
        top = np.take_along_axis(sims, part, axis=1)
        order = np.argsort(-top, axis=1, kind="stable")
        out_i[start : start + b] = np.take_along_axis(part, order, axis=1)
        out_s[start : start + b] = np.take_along_axis(top, order, axis=1)
    return _keep_above(out_i, out_s, threshold)


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def neighbours_faiss(emb: np.ndarray, k: int, threshold: float, *, ivf_min: int = 200_000, nprobe: int = 16) -> Neighbours:
    """Top-k neighbours through a faiss inner-product index (flat, or IVF from ``ivf_min`` rows).

    Raises:
        ImportError: faiss-cpu is not installed.
    """
    try:
        import faiss
    except ImportError:
        raise ImportError("cluster.index=faiss needs faiss-cpu: `pip install 'mmtune[faiss]'`") from None
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    n, d = emb.shape
    k = min(k, n)
    if n >= ivf_min:
        nlist = max(1, int(4 * math.sqrt(n)))
        quantizer = faiss.IndexFlatIP(d)
        index = faiss.IndexIVFFlat(quantizer, d, nlist, faiss.METRIC_INNER_PRODUCT)
        rng = np.random.default_rng(0)
        train = emb[rng.choice(n, size=min(n, nlist * 64), replace=False)]
        index.train(train)
        index.nprobe = nprobe
    else:
        index = faiss.IndexFlatIP(d)
    index.add(emb)
    score, idx = index.search(emb, k)
    return _keep_above(idx, score, threshold)


def find_neighbours(emb: np.ndarray, cfg: ClusterConfig) -> tuple[Neighbours, str]:
    """Neighbours by the configured back-end; returns them and the back-end's name."""
    use_faiss = cfg.index == "faiss" or (
        cfg.index == "auto" and emb.shape[0] >= cfg.faiss_min_entries and faiss_available()
    )
    k = cfg.max_neighbors + 1  # the row itself is its own first neighbour
    if use_faiss:
        return neighbours_faiss(emb, k, cfg.threshold, ivf_min=cfg.faiss_ivf_min, nprobe=cfg.faiss_nprobe), "faiss"
    return neighbours_blocked(emb, k, cfg.threshold, cfg.block_size), "blocked"


def communities(nb: Neighbours, min_size: int) -> list[list[int]]:
    """Disjoint clusters from neighbour lists, largest candidate first (ties: lower row first).

    Returns clusters as lists of row indices, seed first, then by decreasing similarity
    to the seed.
    """
    n = nb.index.shape[0]
    sizes = (nb.index >= 0).sum(axis=1)
    order = np.lexsort((np.arange(n), -sizes))  # size descending, row ascending
    taken = np.zeros(n, dtype=bool)
    clusters: list[list[int]] = []
    for i in order:
        if sizes[i] < min_size:
            break
        if taken[i]:
            continue
        members = [int(j) for j in nb.index[i] if j >= 0 and not taken[j]]
        if int(i) not in members:
            members.insert(0, int(i))
        else:
            members.remove(int(i))
            members.insert(0, int(i))
        if len(members) >= min_size:
            taken[members] = True
            clusters.append(members)
    return clusters


def cluster_embeddings(emb: np.ndarray, cfg: ClusterConfig) -> tuple[list[list[int]], str]:
    """Clusters of ``emb`` rows (unit vectors) and the neighbour back-end used."""
    if emb.shape[0] == 0:
        return [], "none"
    nb, backend = find_neighbours(emb, cfg)
    return communities(nb, cfg.min_size), backend


def size_histogram(clusters: list[list[int]]) -> dict[str, int]:
    """Cluster counts by size bucket (powers of two): ``{"2": 10, "3-4": 7, "5-8": 2, ...}``."""
    hist: dict[str, int] = {}
    for c in clusters:
        n = len(c)
        if n <= 2:
            key = str(n)
        else:
            hi = 1 << (n - 1).bit_length()
            key = f"{hi // 2 + 1}-{hi}"
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0].split("-")[0])))


__all__ = [
    "Neighbours",
    "neighbours_blocked",
    "neighbours_faiss",
    "faiss_available",
    "find_neighbours",
    "communities",
    "cluster_embeddings",
    "size_histogram",
]

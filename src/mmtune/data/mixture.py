"""Mixing named sources into one deterministic, resumable sample order.

Global indices number the records of all sources back to back (source 0 first), so
``global = offsets[source] + record``. For every source the mixture fixes how many
records an epoch takes from it (its *count*):

- ``weights`` unset: ``num_samples`` of the source, or its size;
- ``weights`` set: ``epoch_size`` (default: sum of sizes) split in proportion to the
  weights, measured in samples (``by: samples``) or in estimated tokens (``by: tokens``:
  a source's count is proportional to ``weight / mean_tokens``).

A count below the source size keeps a seeded subset, the same in every epoch (so a
"slice of llava-665k" stays the same slice); a count above it repeats every record
``count // size`` times plus a seeded subset for the remainder. Each epoch then
shuffles all selected indices with ``numpy.random.default_rng([seed, epoch])``: the
order is a pure function of (seed, epoch, config, source sizes), which is what exact
resume needs. Example::

    mixture = build_mixture(load_data_config("add_to_pool"))
    sampler = mixture.sampler(num_replicas=world_size, rank=rank)
    sampler.set_epoch(0)
    for g in sampler:                 # global indices, this rank's share
        dialogue = mixture.dialogues[g]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from mmtune.data.config import DataConfig, MixtureConfig


def _largest_remainder(shares: np.ndarray, total: int) -> list[int]:
    """Integers proportional to ``shares`` that sum exactly to ``total``."""
    raw = shares / shares.sum() * total
    counts = np.floor(raw).astype(np.int64)
    short = total - int(counts.sum())
    # Ties broken by source order so the result is deterministic.
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i] - counts[i]), i))[:short]:
        counts[i] += 1
    return [int(c) for c in counts]


def mixture_counts(
    cfg: MixtureConfig, sizes: Sequence[int], mean_tokens: Sequence[float] | None = None
) -> list[int]:
    """Records each source contributes per epoch (see the module docstring).

    Args:
        cfg: the mixture.
        sizes: records per source (after validation and stacking).
        mean_tokens: mean estimated tokens per record and source; needed for ``by: tokens``.

    Raises:
        ValueError: a source with a positive weight or count has no records, or
            ``by: tokens`` without ``mean_tokens``.
    """
    names = [s.name for s in cfg.sources]
    if cfg.weights is None:
        counts = [s.num_samples if s.num_samples is not None else n for s, n in zip(cfg.sources, sizes)]
    else:
        w = np.array([float(cfg.weights.get(name, 0.0)) for name in names])
        if cfg.by == "tokens":
            if mean_tokens is None:
                raise ValueError("data.mixture.by=tokens needs the sources' mean token estimates")
            mt = np.array([max(float(m), 1.0) for m in mean_tokens])
            w = w / mt
        total = cfg.epoch_size if cfg.epoch_size is not None else int(sum(sizes))
        counts = _largest_remainder(w, total)
    empty = [f"{name} (count {c})" for name, c, n in zip(names, counts, sizes) if c > 0 and n == 0]
    if empty:
        raise ValueError(
            "sources selected by the mixture have no valid records: " + ", ".join(empty)
            + "; check their validation reports (`mmtune data check`) or give them weight 0"
        )
    return counts


def _select(size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    if count <= size:
        return np.sort(rng.permutation(size)[:count])
    repeats, rest = divmod(count, size)
    return np.concatenate([np.tile(np.arange(size), repeats), np.sort(rng.permutation(size)[:rest])])


class MixtureSampler:
    """Deterministic, shardable, exactly resumable order over mixed sources.

    Iterating yields global indices (see :meth:`locate`) of this rank's share of the
    current epoch, starting at the saved position. Rank ``r`` of ``R`` takes positions
    ``r, r + R, ...`` of :meth:`global_order`; with ``drop_last=False`` the order is
    padded by wrapping around so every rank gets the same number of samples (as
    ``torch.utils.data.DistributedSampler`` does), with ``drop_last=True`` the tail
    is dropped instead.

    The position counts indices handed out by ``__iter__``. A ``DataLoader`` with
    workers prefetches ahead of training; the training loop should therefore save the
    number of samples it actually consumed: ``state_dict(consumed=n)``.
    """

    def __init__(
        self,
        source_sizes: Sequence[int],
        counts: Sequence[int] | None = None,
        *,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        shuffle: bool = True,
    ):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
        self.source_sizes = [int(n) for n in source_sizes]
        self.counts = [int(c) for c in (counts if counts is not None else source_sizes)]
        if len(self.counts) != len(self.source_sizes):
            raise ValueError(f"{len(self.counts)} counts for {len(self.source_sizes)} sources")
        self.seed, self.num_replicas, self.rank = seed, num_replicas, rank
        self.drop_last, self.shuffle = drop_last, shuffle
        self.offsets = np.concatenate([[0], np.cumsum(self.source_sizes)]).astype(np.int64)
        self.epoch = 0
        self.position = 0
        # Fixed per-source selections (subset or repeats), independent of the epoch.
        self._selected = np.concatenate(
            [
                self.offsets[i] + _select(n, c, np.random.default_rng([seed, 1_000_003, i]))
                for i, (n, c) in enumerate(zip(self.source_sizes, self.counts))
                if c > 0
            ]
            or [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64)
        self._order_cache: tuple[int, np.ndarray] | None = None

    @classmethod
    def from_config(
        cls,
        cfg: MixtureConfig,
        sources: Sequence[Any],
        *,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
    ) -> "MixtureSampler":
        """Build from a mixture config and loaded sources (``SourceData`` or stacked)."""
        sizes = [len(s.dialogues) for s in sources]
        mean_tokens = None
        if cfg.by == "tokens" and cfg.weights is not None:
            mean_tokens = [
                float(s.estimated_tokens(cfg.tokens_per_image).mean()) if len(s.dialogues) else 1.0 for s in sources
            ]
        counts = mixture_counts(cfg, sizes, mean_tokens)
        return cls(sizes, counts, seed=cfg.seed, num_replicas=num_replicas, rank=rank, drop_last=drop_last)

    @property
    def total(self) -> int:
        """Samples per epoch over all ranks (before padding)."""
        return int(len(self._selected))

    def __len__(self) -> int:
        """Samples per epoch on this rank."""
        if self.drop_last:
            return self.total // self.num_replicas
        return -(-self.total // self.num_replicas)

    def locate(self, global_index: int) -> tuple[int, int]:
        """``(source_index, record_index)`` of a global index."""
        s = int(np.searchsorted(self.offsets, global_index, side="right") - 1)
        return s, int(global_index - self.offsets[s])

    def global_order(self, epoch: int | None = None) -> np.ndarray:
        """All ranks' global indices of an epoch, in order (a batch planner can shard it)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self._selected)
        else:
            order = self._selected.copy()
        self._order_cache = (epoch, order)
        return order

    def rank_order(self, epoch: int | None = None) -> np.ndarray:
        """This rank's global indices of an epoch, padded or truncated to ``len(self)``."""
        order = self.global_order(epoch)
        n = len(self) * self.num_replicas
        if n > len(order) and len(order):
            order = np.resize(order, n)  # wraps around, like DistributedSampler's padding
        return order[:n][self.rank :: self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; the position restarts at 0 only when the epoch changes."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self) -> Iterator[int]:
        order = self.rank_order()
        while self.position < len(order):
            g = int(order[self.position])
            self.position += 1
            yield g

    def _fingerprint(self) -> str:
        ident = [self.source_sizes, self.counts, self.seed, self.num_replicas, self.rank, self.drop_last, self.shuffle]
        return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Epoch and position (``consumed`` overrides the position, see the class note)."""
        return {
            "epoch": self.epoch,
            "position": self.position if consumed is None else int(consumed),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict`.

        Raises:
            ValueError: the state was saved with different sources, counts, seed or
                sharding, so the same position would mean different samples.
        """
        if state.get("fingerprint") != self._fingerprint():
            raise ValueError(
                "sampler state does not match this mixture (source sizes, counts, seed or sharding changed: "
                f"saved {state.get('fingerprint')}, now {self._fingerprint()}); resume with the same data config "
                "and data files, or restart the epoch"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class MixedDialogues(Sequence):
    """Dialogues of all sources addressed by global index."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)
        self.offsets = np.concatenate([[0], np.cumsum([len(s.dialogues) for s in self.sources])]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, global_index: int) -> tuple[int, int]:
        if not 0 <= global_index < len(self):
            raise IndexError(f"global index {global_index} out of range for {len(self)} dialogues")
        s = int(np.searchsorted(self.offsets, global_index, side="right") - 1)
        return s, int(global_index - self.offsets[s])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        s, r = self.locate(int(i) + len(self) if i < 0 else int(i))
        return self.sources[s].dialogues[r]


@dataclass
class Mixture:
    """Loaded sources of a data config, addressable by global index, plus their sampler."""

    config: DataConfig
    sources: list[Any]
    """``SourceData`` per source (a stacked view where stacking applies)."""
    dialogues: MixedDialogues
    counts: list[int]
    """Records each source contributes per epoch."""

    @property
    def reports(self):
        return [s.report for s in self.sources]

    def sampler(self, *, num_replicas: int = 1, rank: int = 0, drop_last: bool = False) -> MixtureSampler:
        return MixtureSampler(
            [len(s.dialogues) for s in self.sources],
            self.counts,
            seed=self.config.mixture.seed,
            num_replicas=num_replicas,
            rank=rank,
            drop_last=drop_last,
        )

    def estimated_tokens(self) -> np.ndarray:
        """Cheap token estimate per global index (exact lengths come from the collator side)."""
        tpi = self.config.mixture.tokens_per_image
        return np.concatenate([s.estimated_tokens(tpi) for s in self.sources]) if self.sources else np.zeros(0)


def build_mixture(data_cfg: DataConfig, *, refresh: bool = False, image_limits: Any = None,
                  num_proc: int | None = None) -> Mixture:
    """Load (through the cache), validate, optionally stack, and mix a data config's sources;
    ``image_limits``: the model's ``model.image_limits`` (default: the defaults); ``num_proc``:
    processes reading a large source (default: ``data.num_proc``, else this process's cores)."""
    from mmtune.data.readers import load_sources
    from mmtune.data.stacking import stack_source

    data_cfg.validate()
    sources: list[Any] = load_sources(data_cfg, refresh=refresh, image_limits=image_limits, num_proc=num_proc)
    st = data_cfg.stacking
    if st.enabled:
        tpi = data_cfg.mixture.tokens_per_image
        sources = [
            stack_source(s, max_images=st.max_images, max_tokens=st.max_tokens, tokens_per_image=tpi, seed=st.seed)
            if st.sources is None or s.name in st.sources
            else s
            for s in sources
        ]
    mix = data_cfg.mixture
    mean_tokens = None
    if mix.by == "tokens" and mix.weights is not None:
        mean_tokens = [float(s.estimated_tokens(mix.tokens_per_image).mean()) if len(s.dialogues) else 1.0 for s in sources]
    counts = mixture_counts(mix, [len(s.dialogues) for s in sources], mean_tokens)
    return Mixture(data_cfg, sources, MixedDialogues(sources), counts)


__all__ = ["mixture_counts", "MixtureSampler", "MixedDialogues", "Mixture", "build_mixture"]

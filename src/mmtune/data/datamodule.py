"""The training data module: sources + mixture + lengths + batch plan + collator + DataLoader.

It owns the dataset and the collate function (as litgpt's data modules do) and gets
the settings known only once the model is built through one :meth:`SFTDataModule.connect`
call: the adapter (tokenizer, template, image token count), the training window, the
rank layout and the gradient accumulation.

Every epoch has its own plan, dealt to the ranks and padded with filler micro-batches
to the same whole number of optimizer steps on every rank
(:func:`~mmtune.data.batching.rank_plan`).

Exact resume: each epoch's batch plan is a pure function of (data config, seed,
epoch, lengths, collator settings, world size, accumulation). The training loop records how many
micro-batches of the epoch it consumed; resuming rebuilds the plan and starts the
DataLoader at that micro-batch, without loading the skipped ones. A hash of the plan
is stored with the checkpoint and checked on resume, so a changed data or collator
config fails loudly instead of silently training on a different order.

Example::

    dm = SFTDataModule(cfg.data, cfg.collator, seed=42)
    dm.connect(adapter, max_length=8192, rank=0, world_size=1, gradient_accumulation_steps=4)
    dm.setup()
    dm.steps_in_epoch(0)  # optimizer steps of epoch 0 (the same on every rank)
    for batch, meta in dm.dataloader(epoch=0, start=0):
        meta["ids"]      # dialogue ids in the batch ([] for a filler)
        meta["tokens"]   # real (non-padding) tokens
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch

from mmtune.core.encoded import IGNORE_INDEX

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.batching import RankPlan
    from mmtune.data.collator import CollatorConfig
    from mmtune.data.config import DataConfig
    from mmtune.models.base import ModelAdapter

__all__ = ["SFTDataModule", "CollateWithMeta"]


class CollateWithMeta:
    """Wraps the pure collator to also return ``{"ids": [...], "tokens": int, "images": int}``.

    Picklable, so it runs in DataLoader workers.
    """

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, examples: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        from mmtune.data.collator import SkippedSample
        from mmtune.data.encoding import Example

        kept = [e for e in examples if isinstance(e, Example)]
        skipped = [e for e in examples if isinstance(e, SkippedSample)]
        # Every sample of the micro-batch skipped (corrupt images, skip mode): a one-token
        # batch with no loss tokens keeps every rank's forward/backward count in step.
        batch = self.collate(kept or [Example("<skipped>", [self.collate.pad_token_id], [IGNORE_INDEX])])
        meta = {"ids": [e.dialogue_id for e in kept], "tokens": sum(len(e) for e in kept),
                "images": sum(len(e.images) for e in kept),
                "skipped": [{"dialogue_id": e.dialogue_id, "source": e.source, "reason": e.reason, "detail": e.detail}
                            for e in skipped]}
        return batch, meta


class SFTDataModule:
    """Builds, plans and serves the training batches of one rank.

    Args:
        data: the ``data`` config (sources, mixture, validation).
        collator: the ``collator`` config (encoding, truncation, batching).
        seed: unused by the order (the mixture's own seed fixes it); kept for workers' RNG.
        num_workers: DataLoader workers (encoding and image decoding happen there).
    """

    def __init__(self, data: "DataConfig", collator: "CollatorConfig", *, seed: int = 0, num_workers: int = 0):
        self.data_config = data
        self.collator_config = collator
        self.seed = seed
        self.num_workers = num_workers
        self.adapter: Optional["ModelAdapter"] = None
        self.rank, self.world_size, self.accumulation = 0, 1, 1
        self._plans: dict[int, "RankPlan"] = {}
        self._plan_hashes: dict[int, str] = {}
        self._steps: dict[int, int] = {}
        self.skipped_items: list[dict[str, Any]] = []
        """Samples dropped while loading on this rank (see :meth:`note_skipped`)."""

    def connect(self, adapter: "ModelAdapter", *, max_length: Optional[int] = None, rank: int = 0,
                world_size: int = 1, gradient_accumulation_steps: int = 1) -> None:
        """Late settings: the adapter, the training window (overrides ``collator.max_length``),
        this process's rank among ``world_size`` and the micro-batches per optimizer step
        (every rank's epoch is padded to whole steps, see :func:`~mmtune.data.batching.rank_plan`)."""
        self.adapter = adapter
        if max_length is not None:
            self.collator_config = replace(self.collator_config, max_length=int(max_length))
        self.rank, self.world_size = rank, world_size
        self.accumulation = int(gradient_accumulation_steps)

    def setup(self) -> None:
        """Load the sources (through the cache), compute exact lengths, build the dataset."""
        from mmtune.data.collator import MultiImageDataset
        from mmtune.data.loss_report import DataLossReport, lengths_per_source
        from mmtune.data.mixture import build_mixture

        if self.adapter is None:
            raise RuntimeError("SFTDataModule.setup() needs connect(adapter, ...) first")
        if self.collator_config.image_errors is None:  # one policy: the data validation mode
            self.collator_config = replace(self.collator_config, image_errors=self.data_config.validation.mode)
        cfg = self.collator_config
        cfg.validate()
        self.mixture = build_mixture(self.data_config, image_limits=getattr(self.adapter.config, "image_limits", None))
        # The plan is built over all ranks' samples and then dealt out by batch (not by
        # sample), so token-budget and packed batches stay whole and ranks never overlap.
        self.order = self.mixture.sampler(num_replicas=1, rank=0)
        self.lengths, per_source = lengths_per_source(
            self.adapter, self.mixture, max_length=cfg.max_length, truncation=cfg.truncation,
            train_on=cfg.train_on, system_prompt=cfg.system_prompt, cache_dir=cfg.length_cache_dir,
            image_errors=cfg.image_errors,
        )
        self.loss_report = DataLossReport.build(self.mixture, per_source, cfg.max_length)
        if self.loss_report.trainable_samples == 0:
            raise ValueError(self.loss_report.why_empty())
        self.dataset = MultiImageDataset(self.mixture.dialogues, self.adapter, cfg)
        self.collate = CollateWithMeta(self.dataset.collator())
        self._plans = {}
        self._plan_hashes = {}
        self._steps: dict[int, int] = {}

    def note_skipped(self, meta: dict[str, Any]) -> int:
        """Keep the samples a batch dropped while loading (``meta["skipped"]``); returns how many.

        They are added to :attr:`loss_report` by :meth:`merge_skipped` (after gathering
        every rank's list)."""
        skipped = meta.get("skipped") or []
        self.skipped_items.extend(skipped)
        return len(skipped)

    def merge_skipped(self, items: list[dict[str, Any]]) -> None:
        """Add every rank's dropped samples to :attr:`loss_report`."""
        if items:
            self.loss_report.add_skipped(items)

    # -- plans -------------------------------------------------------------------------------
    def rank_plan(self, epoch: int) -> "RankPlan":
        """This rank's micro-batches of ``epoch`` (real ones, then fillers), cached.

        Packed and token-budget plans differ from epoch to epoch (the order changes how
        samples fit), so every epoch has its own plan and its own number of steps.
        """
        from mmtune.data.batching import build_plan, rank_plan

        if epoch not in self._plans:
            plan = build_plan(list(self.order.global_order(epoch)), self.lengths.lengths.tolist(),
                              self.collator_config, num_images=self.lengths.num_images.tolist())
            self._plans = {epoch: rank_plan(plan, self.rank, self.world_size, self.accumulation)}  # one in memory
            self._steps[epoch] = self._plans[epoch].steps
            # Of the whole epoch's plan, not of this rank's share: the checkpoint records the
            # main process's hash and every rank compares its own with it on resume.
            # The rank layout is hashed too: it decides which batches a count of micro-batches means.
            key = repr((plan, self.world_size, self.accumulation))
            self._plan_hashes = {epoch: hashlib.sha1(key.encode()).hexdigest()[:16]}
        return self._plans[epoch]

    def plan(self, epoch: int) -> list[list]:
        """This rank's micro-batches of ``epoch`` as DataLoader batches (lists of dataset keys)."""
        packed = self.collator_config.batching == "packing"
        return [[(i, r) for r, row in enumerate(batch) for i in row] if packed else [row[0] for row in batch]
                for batch in self.rank_plan(epoch).batches]

    def num_micro_batches(self, epoch: int) -> int:
        """Micro-batches of ``epoch`` on this rank, fillers included (the same on every rank)."""
        return len(self.rank_plan(epoch).batches)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (the same on every rank)."""
        if epoch not in self._steps:
            self.rank_plan(epoch)
        return self._steps[epoch]

    def plan_hash(self, epoch: int) -> str:
        """A hash of the whole epoch's batch plan (all ranks' micro-batches, before they are dealt
        out): the same on every rank, so one rank's record checks every rank's plan."""
        if epoch not in self._plan_hashes:
            self._plans.pop(epoch, None)
            self.rank_plan(epoch)
        return self._plan_hashes[epoch]

    def state_dict(self, epoch: int, consumed: int) -> dict[str, Any]:
        """Data position to store with a checkpoint (the same on every rank).

        ``consumed`` counts this rank's micro-batches of ``epoch``; with the rank layout
        (``world_size``, ``accumulation``) it fixes which of the plan's batches were trained."""
        return {"epoch": epoch, "consumed": consumed, "plan_hash": self.plan_hash(epoch),
                "world_size": self.world_size, "accumulation": self.accumulation}

    def _saved_kind_of_hash(self, state: dict[str, Any]) -> str:
        """This run's plan hash as ``state`` recorded it: checkpoints without ``accumulation``
        (saved before the hash covered the whole plan) hold the hash of rank 0's share."""
        epoch = int(state["epoch"])
        if "accumulation" in state:
            return self.plan_hash(epoch)
        from mmtune.data.batching import build_plan, rank_plan

        plan = build_plan(list(self.order.global_order(epoch)), self.lengths.lengths.tolist(),
                          self.collator_config, num_images=self.lengths.num_images.tolist())
        rp = rank_plan(plan, 0, self.world_size, self.accumulation)
        return hashlib.sha1(repr((rp.batches, rp.real)).encode()).hexdigest()[:16]

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise when a checkpoint's data position would not mean the same samples now."""
        problems = []
        if state.get("world_size") != self.world_size:
            problems.append(_world_size_problem(state, self.world_size))
        elif state.get("plan_hash") != self._saved_kind_of_hash(state):
            problems.append("the batch plan differs (data files, data/collator config, window, seed or "
                            "gradient accumulation changed)")
        if problems:
            raise ValueError("cannot resume exactly: " + "; ".join(problems)
                             + ". Resume with the same configuration, or start a new output_dir")

    def stats(self, epoch: int = 0) -> dict[str, Any]:
        """Sample counts, truncation and the token utilisation of this rank's real batches of ``epoch``."""
        from mmtune.data.batching import plan_stats

        rp = self.rank_plan(epoch)
        refused = len(self.lengths.image_skipped)  # length 0 too, for an image that cannot be used
        out = {"samples": int(len(self.lengths)),
               "skipped_by_truncation": int((self.lengths.lengths == 0).sum()) - refused,
               "skipped_for_images": refused,
               **{f"truncation/{k}": v for k, v in self.lengths.stats.items()}}
        row = self.collator_config.max_length if self.collator_config.batching == "packing" else None
        out.update({f"plan/{k}": v for k, v in plan_stats(rp.batches[:rp.real], self.lengths.lengths.tolist(),
                                                          row).items()})
        out["plan/filler_batches"] = rp.fillers
        return out

    # -- loading -------------------------------------------------------------------------------
    def dataloader(self, epoch: int, *, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[dict, dict]]:
        """Micro-batches ``start:stop`` of this rank's plan for ``epoch`` as ``(batch, meta)``.

        Filler micro-batches come with every label set to the ignore index, zero loss
        tokens and ``meta["ids"] == []``: they cost a forward and backward, train nothing
        and count as no sample.
        """
        rp = self.rank_plan(epoch)
        first = start
        batches = self.plan(epoch)[start:stop]
        if not batches:
            return iter(())
        generator = torch.Generator()
        generator.manual_seed(self.seed + 1000 * epoch + self.rank)
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=batches, collate_fn=self.collate, num_workers=self.num_workers,
            generator=generator, persistent_workers=False, pin_memory=torch.cuda.is_available(),
        )
        return (_as_filler(item) if first + k >= rp.real else item for k, item in enumerate(loader))


def _world_size_problem(state: dict[str, Any], world_size: int) -> str:
    """Why a data position saved on another number of ranks is refused, and what to do."""
    saved, saved_acc = state.get("world_size"), state.get("accumulation")
    acc_note = f" and training.gradient_accumulation_steps={saved_acc}" if saved_acc is not None else ""
    return (f"it was saved on {saved} ranks, this run has {world_size}. Its data position counts each rank's "
            f"micro-batches of an epoch plan dealt out to {saved} ranks (rank r takes batches r, r+{saved}, ...), "
            f"and resuming does not re-deal that position onto another number of ranks, so the remaining "
            f"samples would not be the uninterrupted run's (model and optimizer shards would load, the data "
            f"order would not match). Relaunch on {saved} ranks (torchrun --nproc_per_node {saved}){acc_note}")


def _as_filler(item: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    from mmtune.core.encoded import IGNORE_INDEX

    batch, _ = item
    batch = {**batch, "labels": torch.full_like(batch["labels"], IGNORE_INDEX),
             "num_loss_tokens": torch.zeros_like(batch["num_loss_tokens"])}
    return batch, {"ids": [], "tokens": 0, "images": 0, "filler": True}

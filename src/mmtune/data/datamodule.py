"""The training data module: sources + mixture + lengths + batch plan + collator + DataLoader.

It owns the dataset and the collate function (as litgpt's data modules do) and gets
the settings known only once the model is built through one :meth:`SFTDataModule.connect`
call: the adapter (tokenizer, template, image token count), the training window, the
rank layout and the gradient accumulation.

An epoch's plan is built whole before step 1, or window by window as training goes
(``collator.plan``, :mod:`mmtune.data.windowed`: step 1 waits for one window's lengths, not
the whole mixture's). Every epoch has its own plan, dealt to the ranks and padded with filler micro-batches
to the same whole number of optimizer steps on every rank
(:func:`~mmtune.data.batching.rank_plan`).

Exact resume: each epoch's batch plan is a pure function of (data config, seed,
epoch, lengths, collator settings); how it is dealt out depends on the rank layout. The
training loop records how many micro-batches of the epoch it consumed; the data position
keeps that count in global terms too (batches of the epoch's plan done, and the global
batch: ranks x gradient accumulation). Resuming rebuilds the plan and starts the
DataLoader at this rank's share of that position, without loading the skipped ones, on
the saved number of ranks or on any other with the same global batch
(:func:`~mmtune.data.batching.resume_micro_batch`). A hash of the plan and the global
batch is stored with the checkpoint and checked on resume, so a changed data or collator
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

import collections
import contextlib
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

__all__ = ["SFTDataModule", "CollateWithMeta", "layout_problem", "saved_global_batch", "length_cache_dir", "rank_cores"]


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
        self.max_steps: Optional[int] = None
        self.windowed = False
        """The plan is built window by window (:mod:`mmtune.data.windowed`)."""
        self._streams: dict[int, Any] = {}
        self.skipped_items: list[dict[str, Any]] = []
        """Samples dropped while loading on this rank (see :meth:`note_skipped`)."""

    def connect(self, adapter: "ModelAdapter", *, max_length: Optional[int] = None, rank: int = 0,
                world_size: int = 1, gradient_accumulation_steps: int = 1, max_steps: Optional[int] = None) -> None:
        """Late settings: the adapter, the training window (overrides ``collator.max_length``),
        this process's rank among ``world_size``, the micro-batches per optimizer step
        (every rank's epoch is padded to whole steps, see :func:`~mmtune.data.batching.rank_plan`)
        and the run's own length in steps, if it has one (``training.max_steps``: a windowed
        plan needs it)."""
        self.max_steps = max_steps
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
        from mmtune.data.parallel_read import available_cores

        if self.adapter is None:
            raise RuntimeError("SFTDataModule.setup() needs connect(adapter, ...) first")
        if self.collator_config.image_errors is None:  # one policy: the data validation mode
            self.collator_config = replace(self.collator_config, image_errors=self.data_config.validation.mode)
        cfg = self.collator_config
        cfg.validate()
        with self._rank_zero_first():  # one rank reads and caches the files; the others open its cache
            # rank 0 reads alone (all its cores); the others find its entries, or on a node
            # that does not share the cache build theirs at once, a share of the cores each
            readers = self.data_config.num_proc or (available_cores() if self.rank == 0
                                                    else rank_cores(self.world_size))
            self.mixture = build_mixture(self.data_config, num_proc=readers,
                                         image_limits=getattr(self.adapter.config, "image_limits", None))
        # The plan is built over all ranks' samples and then dealt out by batch (not by
        # sample), so token-budget and packed batches stay whole and ranks never overlap.
        self.order = self.mixture.sampler(num_replicas=1, rank=0)
        self._plans, self._plan_hashes, self._steps, self._streams = {}, {}, {}, {}
        self.windowed = self._choose_windowed(len(self.order))
        if self.windowed:
            self._setup_windowed()
            return
        self.lengths, per_source = lengths_per_source(
            self.adapter, self.mixture, max_length=cfg.max_length, truncation=cfg.truncation,
            train_on=cfg.train_on, system_prompt=cfg.system_prompt, cache_dir=length_cache_dir(self.data_config, cfg),
            image_errors=cfg.image_errors, **self._length_pass_layout(),
        )
        self.loss_report = DataLossReport.build(self.mixture, per_source, cfg.max_length)
        if self.loss_report.trainable_samples == 0:
            raise ValueError(self.loss_report.why_empty())
        self._build_dataset()

    def _build_dataset(self) -> None:
        from mmtune.data.collator import MultiImageDataset

        self.dataset = MultiImageDataset(self.mixture.dialogues, self.adapter, self.collator_config)
        self.collate = CollateWithMeta(self.dataset.collator())

    def _choose_windowed(self, samples: int) -> bool:
        """Whether this run's plan is windowed (``collator.plan``; see :func:`windowed_problem`).

        Raises:
            ValueError: ``collator.plan=windowed`` where it cannot plan, naming the key to change.
        """
        from mmtune.data.collator import AUTO_WINDOWED_SAMPLES
        from mmtune.data.windowed import windowed_problem

        mode, problem = self.collator_config.plan, windowed_problem(self.collator_config, self.max_steps)
        if mode == "windowed" and problem:
            raise ValueError(problem)
        return mode == "windowed" or (mode == "auto" and not problem and samples > AUTO_WINDOWED_SAMPLES)

    def _setup_windowed(self) -> None:
        """Lengths measured as windows are planned; the first window measured now (an empty epoch fails here)."""
        from mmtune.data.windowed import MeasuredLengths

        cfg = self.collator_config
        options = dict(max_length=cfg.max_length, truncation=cfg.truncation, train_on=cfg.train_on,
                       system_prompt=cfg.system_prompt, image_errors=cfg.image_errors)
        with self._rank_zero_first():  # rank 0 reads the stored lengths back (or measures) first
            self.lengths = MeasuredLengths(self.adapter, self.mixture, options,
                                           length_cache_dir(self.data_config, cfg), rank=self.rank)
            planned = self._stream(0).first_batch_exists()
        self.loss_report = self.windowed_report()
        if not planned:
            raise ValueError(self.loss_report.why_empty())
        self._build_dataset()

    def windowed_report(self) -> Any:
        """The data report over the records measured so far (a windowed plan measures as it goes)."""
        from mmtune.data.loss_report import DataLossReport

        tables, masks = self.lengths.source_tables()
        return DataLossReport.build(self.mixture, tables, self.collator_config.max_length, measured=masks)

    def refresh_report(self) -> None:
        """At the end of training: a windowed plan's data report over every record measured by now,
        and its lengths stored for the next launch (a whole plan's report is complete already)."""
        if self.windowed:
            self.lengths.save()
            self.loss_report = self.windowed_report()

    def _stream(self, epoch: int, *, to_serve: bool = False) -> Any:
        """This rank's windowed plan of ``epoch`` (one epoch's in memory; a new one ``to_serve``
        where the kept one has served micro-batches already)."""
        from mmtune.data.windowed import RankStream, WindowedPlan

        if epoch not in self._streams or (to_serve and self._streams[epoch].started):
            plan = WindowedPlan(self.order.global_order(epoch), self.lengths, self.collator_config)
            self._streams = {epoch: RankStream(plan, self.rank, self.world_size, self.accumulation)}
        return self._streams[epoch]

    @contextlib.contextmanager
    def _rank_zero_first(self):
        """Rank 0 runs the block first, the other ranks of a process group after it."""
        import torch.distributed as dist

        shared = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        if shared and self.rank != 0:
            dist.barrier()
        yield
        if shared and self.rank == 0:
            dist.barrier()

    def _length_pass_layout(self) -> dict[str, Any]:
        """Processes and rank sharing of the length pass: ``data.num_proc`` (default: the cores
        this rank may use), and with several ranks in a process group each measures its share."""
        import torch.distributed as dist

        shared = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        return {"num_proc": self.data_config.num_proc or rank_cores(self.world_size), "rank": self.rank,
                "world_size": self.world_size, "barrier": dist.barrier if shared else None}

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
        from mmtune.data.batching import rank_plan

        if self.windowed:  # its lengths are measured as windows are planned: no whole plan to build
            raise RuntimeError("this run's plan is windowed (collator.plan): its epochs are served by dataloader() "
                               "window by window; set collator.plan=whole for the whole epoch's plan")
        if epoch not in self._plans:
            plan = self._global_plan(epoch)
            self._plans = {epoch: rank_plan(plan, self.rank, self.world_size, self.accumulation)}  # one in memory
            self._steps[epoch] = self._plans[epoch].steps
            # Of the whole epoch's plan, not of this rank's share: the checkpoint records the
            # main process's hash and every rank compares its own with it on resume. The global
            # batch is hashed too: it decides which batches each optimizer step trains, while
            # how many ranks share a step does not.
            self._plan_hashes = {epoch: _hash(repr((plan, self.global_batch)))}
        return self._plans[epoch]

    def _global_plan(self, epoch: int) -> list:
        from mmtune.data.batching import build_plan

        return build_plan(list(self.order.global_order(epoch)), self.lengths.lengths.tolist(),
                          self.collator_config, num_images=self.lengths.num_images.tolist())

    @property
    def global_batch(self) -> int:
        """Micro-batches per optimizer step over all ranks (ranks x gradient accumulation)."""
        return self.world_size * self.accumulation

    def plan(self, epoch: int) -> list[list]:
        """This rank's micro-batches of ``epoch`` as DataLoader batches (lists of dataset keys)."""
        return [self._keys(batch) for batch in self.rank_plan(epoch).batches]

    def _keys(self, batch: Any) -> list:
        """A plan's batch as the dataset's keys: ``(sample, row)`` pairs when packed, else samples."""
        if self.collator_config.batching == "packing":
            return [(i, r) for r, row in enumerate(batch) for i in row]
        return [row[0] for row in batch]

    def num_micro_batches(self, epoch: int) -> int:
        """Micro-batches of ``epoch`` on this rank, fillers included (the same on every rank)."""
        return len(self.rank_plan(epoch).batches)

    def epoch_fraction(self, epoch: int, micro_batches_done: int) -> float:
        """How far into ``epoch`` this rank is: its micro-batches done over the epoch's, or for a
        windowed plan (whose length is not known ahead) the share of the epoch's order planned."""
        if self.windowed:
            stream = self._stream(epoch)
            return min(1.0, stream.plan.position / max(1, len(stream.plan.order)))
        return micro_batches_done / self.num_micro_batches(epoch)

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps of ``epoch`` (the same on every rank)."""
        if self.windowed:
            raise RuntimeError("a windowed plan's steps per epoch are known only at the epoch's end "
                               "(the run's length is training.max_steps)")
        if epoch not in self._steps:
            self.rank_plan(epoch)
        return self._steps[epoch]

    def plan_hash(self, epoch: int, global_consumed: Optional[int] = None) -> str:
        """A hash of the whole epoch's batch plan (all ranks' micro-batches, before they are dealt
        out) and the global batch: the same on every rank and for every rank layout of that
        global batch, so one rank's record checks every rank's plan. A windowed plan's is of
        its first ``global_consumed`` batches (those a checkpoint has trained)."""
        if self.windowed:
            return self._stream(epoch).hash_at(int(global_consumed or 0))
        if epoch not in self._plan_hashes:
            self._plans.pop(epoch, None)
            self.rank_plan(epoch)
        return self._plan_hashes[epoch]

    def state_dict(self, epoch: int, consumed: int) -> dict[str, Any]:
        """Data position to store with a checkpoint (the same on every rank).

        ``consumed`` counts this rank's micro-batches of ``epoch``; ``global_consumed`` is the
        same position as batches of the epoch's plan (``consumed * world_size``), which with
        ``global_batch`` lets a run on another number of ranks continue it."""
        state = {"epoch": epoch, "consumed": consumed, "global_consumed": consumed * self.world_size,
                 "global_batch": self.global_batch, "plan_hash": self.plan_hash(epoch, consumed * self.world_size),
                 "world_size": self.world_size, "accumulation": self.accumulation}
        if self.windowed:
            state["plan"] = "windowed"
            self.lengths.save()  # a resume plans the windows before this position again, from these lengths
        return state

    def layout_problem(self, state: dict[str, Any], *, processes_per_rank: int = 1) -> str:
        """Why ``state`` cannot continue under this module's rank layout (:func:`layout_problem`)."""
        return layout_problem(state, self.world_size, self.accumulation, processes_per_rank=processes_per_rank)

    def _saved_kind_of_hash(self, state: dict[str, Any]) -> str:
        """This run's plan hash as ``state`` recorded it: checkpoints without ``global_batch`` hold
        the hash of the plan with their rank layout; those without ``accumulation`` too (saved
        before the hash covered the whole plan) that of rank 0's share."""
        epoch = int(state["epoch"])
        if self.windowed or state.get("plan") == "windowed":
            if self.windowed != (state.get("plan") == "windowed"):
                return "another plan mode (collator.plan, or training.max_steps with collator.plan=auto)"
            return self.plan_hash(epoch, int(state["global_consumed"]))
        if "global_batch" in state:
            return self.plan_hash(epoch)
        plan = self._global_plan(epoch)
        if "accumulation" in state:
            return _hash(repr((plan, int(state["world_size"]), int(state["accumulation"]))))
        from mmtune.data.batching import rank_plan

        rp = rank_plan(plan, 0, self.world_size, self.accumulation)
        return _hash(repr((rp.batches, rp.real)))

    def check_state(self, state: dict[str, Any], *, processes_per_rank: int = 1) -> None:
        """Raise when a checkpoint's data position would not mean the same samples now.

        Raises:
            ValueError: the rank layouts cannot continue one another (:meth:`layout_problem`,
                naming both and the fix), or the epoch's batch plan differs.
        """
        problem = self.layout_problem(state, processes_per_rank=processes_per_rank)
        if problem:
            raise ValueError(f"cannot resume exactly: {problem}; or start afresh in another training.output_dir")
        if state.get("plan_hash") != self._saved_kind_of_hash(state):
            raise ValueError("cannot resume exactly: the batch plan differs (data files, data/collator config, window, "
                             "seed or gradient accumulation changed). Resume with the same configuration, or start a "
                             "new output_dir")

    def resume_position(self, state: dict[str, Any]) -> int:
        """The micro-batch of ``state["epoch"]`` this rank resumes at (``state`` passed :meth:`check_state`).

        The saved position in this rank layout: the same batches of the epoch's plan done,
        dealt out to this run's ranks."""
        from mmtune.data.batching import resume_micro_batch

        done = state.get("global_consumed", int(state["consumed"]) * int(state.get("world_size", self.world_size)))
        return resume_micro_batch(int(done), self.world_size)

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
        if self.windowed:
            return self._windowed_loader(epoch, start, stop)
        rp = self.rank_plan(epoch)
        first = start
        batches = self.plan(epoch)[start:stop]
        if not batches:
            return iter(())
        loader = self._loader(epoch, batches)
        return (_as_filler(item) if first + k >= rp.real else item for k, item in enumerate(loader))

    def _loader(self, epoch: int, batch_sampler: Any) -> torch.utils.data.DataLoader:
        generator = torch.Generator()
        generator.manual_seed(self.seed + 1000 * epoch + self.rank)
        return torch.utils.data.DataLoader(
            self.dataset, batch_sampler=batch_sampler, collate_fn=self.collate, num_workers=self.num_workers,
            generator=generator, persistent_workers=False, pin_memory=torch.cuda.is_available(),
        )

    def _windowed_loader(self, epoch: int, start: int, stop: Optional[int]) -> Iterator[tuple[dict, dict]]:
        """The windowed plan's micro-batches: the loader asks for them as it goes (planning the
        windows ahead of the training step by its prefetch), fillers marked in order."""
        fillers: collections.deque = collections.deque()

        def batches() -> Iterator[list]:
            for k, (batch, filler) in enumerate(self._stream(epoch, to_serve=True).micro_batches(start), start=start):
                if stop is not None and k >= stop:
                    return
                fillers.append(filler)
                yield self._keys(batch)

        return (_as_filler(item) if fillers.popleft() else item for item in self._loader(epoch, batches()))


def length_cache_dir(data: "DataConfig", collator: "CollatorConfig") -> str:
    """Where a run's lengths are cached: ``collator.length_cache_dir``, or ``lengths/`` under the data cache."""
    import os

    from mmtune.data.config import default_cache_dir

    return collator.length_cache_dir or os.path.join(data.cache_dir or default_cache_dir(), "lengths")


def rank_cores(world_size: int) -> int:
    """The cores one rank may use: this process's CPU affinity shared by the ranks on the node."""
    import os

    from mmtune.data.parallel_read import available_cores

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or 1)
    return max(1, available_cores() // max(1, local))


def layout_problem(state: dict[str, Any], world_size: int, accumulation: int, *, processes_per_rank: int = 1) -> str:
    """Why the data position ``state`` (:meth:`SFTDataModule.state_dict`), saved under its rank
    layout, cannot continue on ``world_size`` ranks x ``accumulation``; empty when it can.

    Needs no data and no plan, so a resume checks it before anything is built. Positions
    saved before the global batch was recorded name their accumulation and continue on
    another layout as newer ones do; the oldest, without it, resume on their own number of
    ranks only.

    Args:
        processes_per_rank: processes sharing one data rank (the sequence-parallel size),
            for the launch command a refusal names.
    """
    from mmtune.data.batching import layout_problem as problem_of_layouts

    def _ranks(n: int) -> str:
        return f"{n} rank" + ("s" if n != 1 else "")

    saved_ranks = int(state.get("world_size", world_size))
    if "accumulation" not in state:
        if saved_ranks == world_size:
            return ""
        return (f"it was saved on {_ranks(saved_ranks)} by an mmtune that did not record its gradient accumulation, "
                f"so its data position cannot move onto {_ranks(world_size)}. Relaunch on {_ranks(saved_ranks)} "
                f"(torchrun --nproc_per_node {saved_ranks * processes_per_rank})")
    return problem_of_layouts(saved_ranks, int(state["accumulation"]), world_size, accumulation,
                              consumed=int(state["consumed"]), processes_per_rank=processes_per_rank)


def saved_global_batch(state: dict[str, Any]) -> Optional[int]:
    """The global batch (ranks x accumulation) a data position was saved with; ``None`` for the
    oldest positions, which did not record their accumulation."""
    if "accumulation" not in state:
        return None
    return int(state.get("global_batch", int(state["world_size"]) * int(state["accumulation"])))


def _hash(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _as_filler(item: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    from mmtune.core.encoded import IGNORE_INDEX

    batch, _ = item
    batch = {**batch, "labels": torch.full_like(batch["labels"], IGNORE_INDEX),
             "num_loss_tokens": torch.zeros_like(batch["num_loss_tokens"])}
    return batch, {"ids": [], "tokens": 0, "images": 0, "filler": True}

"""Batch plans: which samples go into which batch (and which packed row), from lengths alone.

A plan is computed from the sampler's ordered indices and the cached per-sample lengths
(:mod:`mmtune.data.lengths`), touches no pixels and no tokens, and is deterministic: the
same order and lengths always give the same plan. That makes exact resume simple:
recompute the plan for the epoch and skip the batches already consumed
(:class:`PlannedBatchSampler`).

A plan is a list of batches; a batch is a tuple of rows; a row is a tuple of sample
indices (one index per row unless packing). Samples with length 0 (skipped by truncation)
never enter a plan.

Modes:

- ``padding``: ``batch_size`` samples per batch in sampler order.
- ``length_grouped``: transformers' megabatch trick: split the order into megabatches of
  ``batch_size * megabatch_mult`` samples, sort each by length (longest first), cut into
  batches; the batch holding the longest sample goes first so an out-of-memory shows at
  step 0.
- ``token_budget``: within each megabatch, sorted by length, batches grow while
  ``rows * longest <= max_tokens`` and ``images <= max_images``.
- ``packing``: each window of ``packing_window`` samples into rows of ``max_length`` tokens
  (and at most ``max_images`` images per batch) by first-fit-decreasing or minimum bin slack
  (or both: see :func:`plan_packing`), whichever needs the fewest rows, then ``batch_size``
  rows per batch.

Ranks: :func:`rank_plan` deals an epoch's batches round-robin and tops every rank up to
the same whole number of optimizer steps with filler batches (trained with no loss
token), so ranks stay in step; :func:`steps_per_epoch` is the resulting step count.

Rank layouts: on ``W`` ranks with ``a`` micro-batches per optimizer step, step ``s`` trains
exactly the epoch's batches ``[s*W*a, (s+1)*W*a)`` (those past the plan's end are fillers),
spread over the ranks. A layout is therefore known to the data by its *global batch*
``W*a`` alone: a position saved under one layout continues exactly under any other with
the same global batch (:func:`resume_micro_batch`, :func:`layout_problem`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

__all__ = [
    "Plan",
    "plan_padding",
    "plan_length_grouped",
    "plan_token_budget",
    "plan_packing",
    "pack_window",
    "build_plan",
    "shard_plan",
    "steps_per_epoch",
    "RankPlan",
    "rank_plan",
    "resume_micro_batch",
    "layout_problem",
    "plan_stats",
    "PlannedBatchSampler",
]

Row = tuple[int, ...]
Batch = tuple[Row, ...]
Plan = list[Batch]


def _valid(order: Iterable[int], lengths: Sequence[int]) -> list[int]:
    return [int(i) for i in order if lengths[int(i)] > 0]


def _check_fits(index: int, length: int, max_length: int) -> None:
    if length > max_length:
        raise ValueError(
            f"sample {index} is {length} tokens, over the row length {max_length}; lengths must be computed "
            "with the same collator.max_length (truncation) as the plan"
        )


def plan_padding(order: Iterable[int], lengths: Sequence[int], batch_size: int, drop_last: bool = False) -> Plan:
    """``batch_size`` samples per batch, in sampler order."""
    idx = _valid(order, lengths)
    plan = [tuple((i,) for i in idx[s : s + batch_size]) for s in range(0, len(idx), batch_size)]
    if drop_last and plan and len(plan[-1]) < batch_size:
        plan.pop()
    return plan


def plan_length_grouped(
    order: Iterable[int],
    lengths: Sequence[int],
    batch_size: int,
    megabatch_mult: int = 50,
    drop_last: bool = False,
) -> Plan:
    """Megabatch length grouping, as ``transformers.trainer_pt_utils.get_length_grouped_indices``."""
    idx = _valid(order, lengths)
    mega = batch_size * megabatch_mult
    plan: Plan = []
    for s in range(0, len(idx), mega):
        chunk = sorted(idx[s : s + mega], key=lambda i: (-lengths[i], i))
        plan.extend(tuple((i,) for i in chunk[b : b + batch_size]) for b in range(0, len(chunk), batch_size))
    if drop_last and plan and len(plan[-1]) < batch_size:
        plan.pop()
    if plan:
        longest = max(range(len(plan)), key=lambda b: max(lengths[r[0]] for r in plan[b]))
        plan[0], plan[longest] = plan[longest], plan[0]
    return plan


def plan_token_budget(
    order: Iterable[int],
    lengths: Sequence[int],
    max_tokens: int,
    *,
    num_images: Sequence[int] | None = None,
    max_images: int | None = None,
    megabatch: int = 1000,
) -> Plan:
    """Batches of padded size ``rows * longest <= max_tokens`` (and ``<= max_images`` images)."""
    idx = _valid(order, lengths)
    plan: Plan = []
    for s in range(0, len(idx), megabatch):
        chunk = sorted(idx[s : s + megabatch], key=lambda i: (-lengths[i], i))
        current: list[int] = []
        longest = 0
        images = 0
        for i in chunk:
            _check_fits(i, lengths[i], max_tokens)
            n_img = int(num_images[i]) if num_images is not None else 0
            if max_images is not None and n_img > max_images:
                raise ValueError(
                    f"sample {i} has {n_img} images, over collator.max_images_per_batch={max_images}; raise it"
                )
            new_longest = max(longest, lengths[i])
            over_tokens = (len(current) + 1) * new_longest > max_tokens
            over_images = max_images is not None and images + n_img > max_images
            if current and (over_tokens or over_images):
                plan.append(tuple((j,) for j in current))
                current, longest, images = [], 0, 0
                new_longest = lengths[i]
            current.append(i)
            longest = new_longest
            images += n_img
        if current:
            plan.append(tuple((j,) for j in current))
    return plan


def plan_packing(
    order: Iterable[int],
    lengths: Sequence[int],
    max_length: int,
    *,
    rows_per_batch: int = 1,
    window: int = 512,
    num_images: Sequence[int] | None = None,
    max_images: int | None = None,
) -> Plan:
    """Pack samples into rows of ``max_length`` tokens, each window of ``window`` samples on its own.

    A window is packed by first-fit-decreasing, by minimum bin slack (each row opened by the
    longest sample left and filled with the subset of the others that leaves the least room),
    and by first-fit-decreasing with the samples of its emptiest 10 / 20 / 40 % of rows packed
    again by minimum bin slack; the packing with the fewest rows is kept (first-fit-decreasing
    on a tie). All are deterministic.
    ``max_images`` bounds the images of one batch (rows_per_batch rows): each row is then capped
    at ``max_images // rows_per_batch`` images.
    """
    idx = _valid(order, lengths)
    row_image_cap = None if max_images is None else max(1, max_images // rows_per_batch)
    size = {i: int(lengths[i]) for i in idx}
    images = {i: int(num_images[i]) if num_images is not None else 0 for i in idx}
    rows: list[list[int]] = []
    for s in range(0, len(idx), window):
        rows.extend(pack_window(idx[s : s + window], size, images, max_length, row_image_cap,
                                max_images=max_images, rows_per_batch=rows_per_batch))
    return [tuple(tuple(r) for r in rows[s : s + rows_per_batch]) for s in range(0, len(rows), rows_per_batch)]


def pack_window(window: list[int], size: dict[int, int], images: dict[int, int], max_length: int,
                row_image_cap: int | None, *, max_images: int | None = None, rows_per_batch: int = 1) -> list[list[int]]:
    """The rows of one packing window (see :func:`plan_packing`): the fewest of the candidate packings."""
    chunk = sorted(window, key=lambda i: (-size[i], i))
    for i in chunk:
        _check_fits(i, size[i], max_length)
        if row_image_cap is not None and images[i] > row_image_cap:
            raise ValueError(
                f"sample {i} has {images[i]} images, over the per-row cap {row_image_cap} "
                f"(collator.max_images_per_batch={max_images} / batch_size={rows_per_batch}); raise it"
            )
    first_fit = _first_fit_decreasing(chunk, size, images, max_length, row_image_cap)
    candidates = [first_fit, _minimum_bin_slack(chunk, size, images, max_length, row_image_cap)]
    # first-fit-decreasing's fullest rows kept, the samples of its emptiest ones packed again
    fullest = sorted(range(len(first_fit)), key=lambda r: (-sum(size[i] for i in first_fit[r]), r))
    for share in _REPACKED_SHARES:
        k = int(len(first_fit) * share)
        if k < 2:
            continue
        pool = sorted((i for r in fullest[-k:] for i in first_fit[r]), key=lambda i: (-size[i], i))
        again = _minimum_bin_slack(pool, size, images, max_length, row_image_cap)
        if again is not None and len(again) < k:
            kept = sorted(fullest[:-k])
            candidates.append([first_fit[r] for r in kept] + again)
    return min((c for c in candidates if c is not None), key=len)  # the first of the fewest rows


#: shares of first-fit-decreasing's emptiest rows whose samples minimum bin slack packs again
_REPACKED_SHARES = (0.1, 0.2, 0.4)


def _first_fit_decreasing(chunk: list[int], size: dict[int, int], images: dict[int, int], max_length: int,
                          cap: int | None) -> list[list[int]]:
    """Each sample (longest first) into the first row with room for it."""
    bins: list[list[int]] = []
    space: list[int] = []
    used: list[int] = []
    for i in chunk:
        for b in range(len(bins)):
            if space[b] >= size[i] and (cap is None or used[b] + images[i] <= cap):
                bins[b].append(i)
                space[b] -= size[i]
                used[b] += images[i]
                break
        else:
            bins.append([i])
            space.append(max_length - size[i])
            used.append(images[i])
    return bins


def _minimum_bin_slack(chunk: list[int], size: dict[int, int], images: dict[int, int], max_length: int,
                       cap: int | None) -> list[list[int]] | None:
    """Rows opened by the longest sample left, each filled with the subset of the others whose
    lengths sum closest to the room left (exact subset sum on a bitset of reachable sums, the
    longer samples preferred); ``None`` where a row would hold more than ``cap`` images."""
    remaining = list(chunk)  # longest first
    rows: list[list[int]] = []
    while remaining:
        first, rest = remaining[0], remaining[1:]
        room = max_length - size[first]
        fits = [i for i in rest if size[i] <= room]
        mask = (1 << (room + 1)) - 1
        reach = 1  # bit t: a subset of the candidates so far sums to t
        history = [reach]
        for i in fits:
            reach = (reach | (reach << size[i])) & mask
            history.append(reach)
        target = reach.bit_length() - 1
        chosen = set()
        for k in range(len(fits), 0, -1):  # a candidate is taken only where the longer ones cannot reach
            if not (history[k - 1] >> target) & 1:
                chosen.add(fits[k - 1])
                target -= size[fits[k - 1]]
        row = [first] + [i for i in fits if i in chosen]
        if cap is not None and sum(images[i] for i in row) > cap:
            return None
        rows.append(row)
        remaining = [i for i in rest if i not in chosen]
    return rows


def build_plan(
    order: Iterable[int],
    lengths: Sequence[int],
    config: Any,
    *,
    num_images: Sequence[int] | None = None,
) -> Plan:
    """The plan for ``config.batching`` (a :class:`~mmtune.data.collator.CollatorConfig`)."""
    mode = config.batching
    if mode == "padding":
        return plan_padding(order, lengths, config.batch_size, config.drop_last)
    if mode == "length_grouped":
        return plan_length_grouped(order, lengths, config.batch_size, config.megabatch_mult, config.drop_last)
    if mode == "token_budget":
        budget = config.max_tokens_per_batch or config.batch_size * config.max_length
        return plan_token_budget(
            order,
            lengths,
            budget,
            num_images=num_images,
            max_images=config.max_images_per_batch,
            megabatch=config.batch_size * config.megabatch_mult,
        )
    if mode == "packing":
        plan = plan_packing(
            order,
            lengths,
            config.max_length,
            rows_per_batch=config.batch_size,
            window=config.packing_window,
            num_images=num_images,
            max_images=config.max_images_per_batch,
        )
        if config.drop_last and plan and len(plan[-1]) < config.batch_size:
            plan.pop()
        return plan
    raise ValueError(f"collator.batching={mode!r}; use padding, length_grouped, token_budget or packing")


def shard_plan(plan: Plan, rank: int, world_size: int) -> Plan:
    """This rank's batches: ``plan[rank::world_size]``, every rank the same number of batches.

    When the plan does not divide evenly, the first batches are reused to fill the last
    round (as ``DistributedSampler`` repeats samples), so no rank waits at a collective.
    The training data module uses :func:`rank_plan` instead, which repeats no sample
    and also evens out gradient-accumulation groups.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if not plan:
        return []
    per_rank = -(-len(plan) // world_size)
    padded = list(plan) + [plan[i % len(plan)] for i in range(per_rank * world_size - len(plan))]
    return padded[rank::world_size]


def steps_per_epoch(num_batches: int, world_size: int = 1, accumulation: int = 1) -> int:
    """Optimizer steps of an epoch whose (global) plan has ``num_batches`` micro-batches.

    Every step takes ``accumulation`` micro-batches on each of ``world_size`` ranks; the
    last step of an epoch may be partial and still counts (see :func:`rank_plan`). The
    training loop and ``mmtune plan`` both count with this function.
    """
    if world_size < 1 or accumulation < 1:
        raise ValueError(f"world_size={world_size} and accumulation={accumulation} must be >= 1")
    per_rank = -(-int(num_batches) // world_size)
    return -(-per_rank // accumulation)


@dataclass(frozen=True)
class RankPlan:
    """One rank's micro-batches of one epoch.

    ``batches[:real]`` are this rank's share of the epoch's plan; ``batches[real:]`` are
    fillers: copies of a real batch that the loader serves with every label masked, so
    they run forward and backward (keeping collectives in step) but carry no loss token
    and add exactly nothing to the gradient.
    """

    batches: Plan
    real: int
    steps: int

    @property
    def fillers(self) -> int:
        return len(self.batches) - self.real


def rank_plan(plan: Plan, rank: int, world_size: int, accumulation: int = 1) -> RankPlan:
    """This rank's share of an epoch's ``plan``, padded so that all ranks stay in step.

    Rank ``r`` takes batches ``r, r + world_size, ...`` (every batch on exactly one rank,
    so every sample is seen once per epoch). Each rank then gets the same number of
    micro-batches, ``steps_per_epoch(len(plan), world_size, accumulation) * accumulation``:
    ranks short of it (an uneven last round, a partial last accumulation group) are
    topped up with filler batches at the end of the epoch. The rule is deterministic and
    depends only on the plan, the rank layout and the accumulation, so it is the same on
    every rank and on resume.

    The final, partial accumulation group is therefore trained, not dropped: its real
    micro-batches are weighted by their loss tokens like any other step's.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    steps = steps_per_epoch(len(plan), world_size, accumulation)
    own = list(plan[rank::world_size])
    # A filler repeats this rank's last batch (or, for a rank without any, one of the
    # plan's): a shape the rank already handles, so no new memory peak.
    filler = own[-1] if own else (plan[rank % len(plan)] if plan else None)
    real = len(own)
    own += [filler] * (steps * accumulation - real)
    return RankPlan(batches=own, real=real, steps=steps)


def resume_micro_batch(global_consumed: int, world_size: int) -> int:
    """The micro-batch each of ``world_size`` ranks resumes at, where the first ``global_consumed``
    batches of an epoch's plan are done.

    Rank ``r`` of ``W`` takes the batches ``r, r + W, ...`` (:func:`rank_plan`), so after
    ``c`` micro-batches per rank exactly the first ``c * W`` batches of the epoch (fillers
    counted on from the plan's end) are done, whatever ``W``: a position saved on ``W``
    ranks is ``global_consumed = c * W``, and on ``W'`` ranks it ends at micro-batch
    ``c * W / W'`` of every rank.

    Raises:
        ValueError: the position does not end at the same micro-batch of every rank (check
            the layouts with :func:`layout_problem` first).
    """
    if global_consumed % world_size:
        raise ValueError(f"{global_consumed} micro-batches of the epoch done do not divide over {world_size} ranks")
    return int(global_consumed) // world_size


def _launch(ranks: int, processes_per_rank: int) -> str:
    return f"torchrun --nproc_per_node {ranks * processes_per_rank}"


def layout_problem(saved_world_size: int, saved_accumulation: int, world_size: int, accumulation: int, *,
                   consumed: int = 0, processes_per_rank: int = 1) -> str:
    """Why a data position saved on ``saved_world_size`` ranks x ``saved_accumulation`` micro-batches
    per step cannot continue exactly on ``world_size`` x ``accumulation``; empty when it can.

    It can when both layouts have the same global batch (micro-batches per optimizer step over
    all ranks) and the position ends an optimizer step (every checkpoint does): each step
    after it then trains the same batches as the uninterrupted run, and the loss, weighted by
    the step's loss tokens over all ranks, sums them in another order only.

    Args:
        consumed: micro-batches each saved rank had consumed of its epoch.
        processes_per_rank: processes that share one data rank (the sequence-parallel size),
            for the launch command the message names.

    Returns:
        One sentence naming both layouts and the fix: the accumulation that keeps the global
        batch on ``world_size`` ranks, or the rank counts that can hold it.
    """
    saved = saved_world_size * saved_accumulation
    now = world_size * accumulation
    if saved == now:
        if (saved_world_size, saved_accumulation) != (world_size, accumulation) and consumed % saved_accumulation:
            return (f"its data position ({consumed} micro-batches per rank) is inside an optimizer step of "
                    f"{saved_accumulation} micro-batches, so it cannot move onto another rank layout; resume it on "
                    f"{_ranks(saved_world_size)} ({_launch(saved_world_size, processes_per_rank)}) with "
                    f"training.gradient_accumulation_steps={saved_accumulation}")
        return ""
    said = (f"it was saved on {_ranks(saved_world_size)} x training.gradient_accumulation_steps={saved_accumulation} "
            f"({saved} micro-batches per optimizer step), this run has {_ranks(world_size)} x {accumulation} ({now}): "
            f"the steps after the checkpoint would group the epoch's batches otherwise than the interrupted run. ")
    if saved % world_size == 0:
        return said + (f"Set training.gradient_accumulation_steps={saved // world_size} to keep {saved} micro-batches "
                       f"per step on {_ranks(world_size)}")
    fitting = [n for n in range(1, saved + 1) if saved % n == 0]
    return said + (f"{saved} micro-batches do not divide over {_ranks(world_size)}: relaunch on a number of ranks N "
                   f"that divides {saved} ({', '.join(map(str, fitting))}) with training.gradient_accumulation_steps="
                   f"{saved}/N, e.g. {_launch(saved_world_size, processes_per_rank)} with "
                   f"training.gradient_accumulation_steps={saved_accumulation}")


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def plan_stats(plan: Plan, lengths: Sequence[int], row_length: int | None = None) -> dict[str, float]:
    """Token utilisation: real tokens / tokens computed (rows x padded width).

    ``row_length`` fixes the padded width (packing to ``max_length``); by default each batch
    pads to its longest row.
    """
    real = 0
    computed = 0
    for batch in plan:
        row_lengths = [sum(lengths[i] for i in row) for row in batch]
        real += sum(row_lengths)
        computed += len(batch) * (row_length or max(row_lengths))
    return {
        "batches": float(len(plan)),
        "real_tokens": float(real),
        "computed_tokens": float(computed),
        "utilization": real / computed if computed else 0.0,
    }


def _plan_hash(plan: Plan) -> str:
    digest = hashlib.sha1()
    for batch in plan:
        digest.update(repr(batch).encode())
    return digest.hexdigest()[:16]


class PlannedBatchSampler:
    """A resumable, rank-sharded batch sampler over a deterministic plan.

    Use as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``. Each epoch the
    plan is rebuilt from ``order_fn(epoch)`` (e.g. the mixture sampler's order) and the
    cached lengths, sharded across ranks, and iterated from the resume point.

    Yields lists of sample indices, or for packing lists of ``(index, row)`` pairs that
    :class:`~mmtune.data.collator.MultiImageDataset` understands.

    Resume: the DataLoader prefetches, so the sampler cannot know what training consumed.
    Save ``sampler.state_dict(consumed=batches_this_epoch)`` with the checkpoint and call
    :meth:`load_state_dict` before building the iterator; the next iteration skips exactly
    those batches (and checks that the plan is unchanged).

    Args:
        order_fn: ``epoch -> ordered global sample indices`` (deterministic).
        lengths: post-truncation length per global index (0 = skipped).
        config: a CollatorConfig (batching mode and sizes).
        num_images: images per sample (for image caps), optional.
        rank, world_size: this process's shard.
    """

    def __init__(
        self,
        order_fn: Callable[[int], Iterable[int]],
        lengths: Sequence[int],
        config: Any,
        *,
        num_images: Sequence[int] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.order_fn = order_fn
        self.lengths = np.asarray(lengths)
        self.num_images = None if num_images is None else np.asarray(num_images)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self._skip = 0
        self._expected_hash: str | None = None
        self._yielded = 0
        self._cache: tuple[int, Plan] | None = None

    def _plan(self) -> Plan:
        if self._cache is None or self._cache[0] != self.epoch:
            plan = build_plan(
                list(self.order_fn(self.epoch)), self.lengths.tolist(), self.config,
                num_images=None if self.num_images is None else self.num_images.tolist(),
            )
            self._cache = (self.epoch, shard_plan(plan, self.rank, self.world_size))
        return self._cache[1]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self._plan())

    def __iter__(self) -> Iterator[list]:
        plan = self._plan()
        if self._expected_hash is not None and _plan_hash(plan) != self._expected_hash:
            raise RuntimeError(
                f"the batch plan of epoch {self.epoch} on rank {self.rank} differs from the checkpoint's: the "
                "data order, lengths, collator settings or world size changed since it was saved; resume with the "
                "same data and collator config, or start a new run"
            )
        start, self._skip, self._expected_hash = self._skip, 0, None
        packed = self.config.batching == "packing"
        self._yielded = start
        for batch in plan[start:]:
            self._yielded += 1
            if packed:
                yield [(i, r) for r, row in enumerate(batch) for i in row]
            else:
                yield [row[0] for row in batch]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Resume state. ``consumed``: batches of this epoch the training loop actually used
        (default: batches yielded so far, which runs ahead of training by the prefetch)."""
        return {
            "epoch": self.epoch,
            "consumed": self._yielded if consumed is None else int(consumed),
            "plan_hash": _plan_hash(self._plan()),
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("world_size", self.world_size) != self.world_size:
            raise ValueError(
                f"checkpoint was saved with world_size {state['world_size']}, this run has {self.world_size}; "
                "an exact resume needs the same number of ranks"
            )
        self.epoch = int(state["epoch"])
        self._skip = int(state["consumed"])
        self._expected_hash = state.get("plan_hash")

"""Batch plans: determinism, coverage, caps, rank sharding and exact resume."""

import numpy as np
import pytest

from mmtune.data.batching import (
    PlannedBatchSampler,
    build_plan,
    layout_problem,
    plan_length_grouped,
    plan_packing,
    plan_padding,
    plan_stats,
    plan_token_budget,
    rank_plan,
    resume_micro_batch,
    shard_plan,
    steps_per_epoch,
)
from mmtune.data.collator import CollatorConfig

RNG = np.random.default_rng(0)
LENGTHS = [int(x) for x in RNG.integers(50, 4000, size=600)]
LENGTHS[7] = 0  # skipped by truncation
IMAGES = [int(x) for x in RNG.integers(0, 6, size=600)]
ORDER = [int(x) for x in RNG.permutation(600)]


def _indices(plan):
    return [i for batch in plan for row in batch for i in row]


@pytest.mark.parametrize("mode", ["padding", "length_grouped", "token_budget", "packing"])
def test_every_sample_exactly_once_and_deterministic(mode):
    cfg = CollatorConfig(max_length=4096, batching=mode, batch_size=4, max_tokens_per_batch=8192, megabatch_mult=8)
    plan = build_plan(ORDER, LENGTHS, cfg, num_images=IMAGES)
    assert sorted(_indices(plan)) == sorted(i for i in range(600) if i != 7)
    assert plan == build_plan(ORDER, LENGTHS, cfg, num_images=IMAGES)


def test_padding_keeps_sampler_order():
    plan = plan_padding(ORDER, LENGTHS, 3)
    assert _indices(plan) == [i for i in ORDER if i != 7]
    assert all(len(b) == 3 for b in plan[:-1])


def test_length_grouping_reduces_padding_and_puts_the_longest_first():
    plain = plan_stats(plan_padding(ORDER, LENGTHS, 8), LENGTHS)["utilization"]
    grouped_plan = plan_length_grouped(ORDER, LENGTHS, 8, megabatch_mult=16)
    grouped = plan_stats(grouped_plan, LENGTHS)["utilization"]
    assert grouped > plain + 0.1
    assert max(LENGTHS[r[0]] for r in grouped_plan[0]) == max(LENGTHS)


def test_token_budget_and_image_caps():
    plan = plan_token_budget(ORDER, LENGTHS, 8192, num_images=IMAGES, max_images=8, megabatch=200)
    for batch in plan:
        rows = [r[0] for r in batch]
        assert len(rows) * max(LENGTHS[i] for i in rows) <= 8192
        assert sum(IMAGES[i] for i in rows) <= 8
    with pytest.raises(ValueError, match="over the row length"):
        plan_token_budget([0], [9000], 8192)


def test_packing_fills_rows_and_respects_caps():
    plan = plan_packing(ORDER, LENGTHS, 8192, rows_per_batch=2, window=200, num_images=IMAGES, max_images=40)
    for batch in plan:
        assert len(batch) <= 2
        for row in batch:
            assert sum(LENGTHS[i] for i in row) <= 8192
            assert sum(IMAGES[i] for i in row) <= 20
    stats = plan_stats(plan, LENGTHS, row_length=8192)
    assert stats["utilization"] > 0.9


def test_packing_takes_the_least_slack_rows_where_first_fit_needs_more():
    # first-fit-decreasing: (5, 4) (3, 3, 3) (2); the sum is 20, so two full rows exist
    lengths = [3, 5, 2, 3, 4, 3]
    plan = plan_packing(range(6), lengths, 10, window=6)
    assert sorted(sorted(lengths[i] for i in row) for (row,) in plan) == [[2, 3, 5], [3, 3, 4]]
    assert plan == plan_packing(range(6), lengths, 10, window=6)
    # with at most two images per row, the least-slack rows (three samples of one image) are not
    # allowed and first-fit-decreasing's rows stay
    capped = plan_packing(range(6), lengths, 10, window=6, num_images=[1] * 6, max_images=2)
    assert [[lengths[i] for i in row] for (row,) in capped] == [[5, 4], [3, 3], [3, 2]]


def test_packing_never_needs_more_rows_than_first_fit_decreasing():
    from mmtune.data.batching import _first_fit_decreasing

    valid = [i for i in ORDER if LENGTHS[i] > 0]
    for window in (50, 200):
        plan = plan_packing(ORDER, LENGTHS, 8192, window=window)
        first_fit = sum(
            len(_first_fit_decreasing(sorted(valid[s:s + window], key=lambda i: (-LENGTHS[i], i)),
                                      {i: LENGTHS[i] for i in valid}, {i: 0 for i in valid}, 8192, None))
            for s in range(0, len(valid), window)
        )
        assert len(plan) <= first_fit
        assert all(sum(LENGTHS[i] for i in row) <= 8192 for (row,) in plan)


def test_shards_are_disjoint_and_equal_sized():
    plan = plan_padding(ORDER, LENGTHS, 4)  # 150 batches
    shards = [shard_plan(plan, r, 4) for r in range(4)]
    assert len({len(s) for s in shards}) == 1
    assert sum(len(s) for s in shards) - len(plan) < 4  # only the last round is topped up
    firsts = [set(map(tuple, s[: len(plan) // 4])) for s in shards]
    assert all(not (firsts[a] & firsts[b]) for a in range(4) for b in range(a + 1, 4))
    covered = {b for s in shards for b in s}
    assert covered == set(plan)


@pytest.mark.parametrize("mode", ["length_grouped", "packing"])
def test_resume_continues_exactly(mode):
    cfg = CollatorConfig(max_length=4096, batching=mode, batch_size=2, megabatch_mult=4, packing_window=64)

    def order(epoch):
        return list(np.random.default_rng(epoch).permutation(600))

    full = PlannedBatchSampler(order, LENGTHS, cfg, rank=1, world_size=2)
    full.set_epoch(3)
    reference = list(full)
    interrupted = PlannedBatchSampler(order, LENGTHS, cfg, rank=1, world_size=2)
    interrupted.set_epoch(3)
    iterator = iter(interrupted)
    consumed = [next(iterator) for _ in range(5)]
    state = interrupted.state_dict(consumed=5)
    resumed = PlannedBatchSampler(order, LENGTHS, cfg, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert consumed + list(resumed) == reference
    if mode == "packing":
        assert all(isinstance(k, tuple) for k in reference[0])


def test_resume_refuses_a_changed_plan():
    cfg = CollatorConfig(batching="padding", batch_size=2)
    sampler = PlannedBatchSampler(lambda e: ORDER, LENGTHS, cfg)
    state = sampler.state_dict(consumed=3)
    changed = PlannedBatchSampler(lambda e: ORDER[::-1], LENGTHS, cfg)
    changed.load_state_dict(state)
    with pytest.raises(RuntimeError, match="differs from the checkpoint"):
        next(iter(changed))
    with pytest.raises(ValueError, match="world_size 1"):
        PlannedBatchSampler(lambda e: ORDER, LENGTHS, cfg, rank=0, world_size=2).load_state_dict(state)


def test_drop_last_drops_only_a_short_final_batch():
    keep = build_plan(ORDER, LENGTHS, CollatorConfig(batching="packing", batch_size=4, max_length=4096))
    drop = build_plan(ORDER, LENGTHS, CollatorConfig(batching="packing", batch_size=4, max_length=4096, drop_last=True))
    assert drop == (keep[:-1] if len(keep[-1]) < 4 else keep)
    padded = build_plan(ORDER, LENGTHS, CollatorConfig(batching="padding", batch_size=7, drop_last=True))
    assert all(len(b) == 7 for b in padded)


@pytest.mark.parametrize("world_size,accumulation", [(1, 1), (1, 4), (2, 1), (2, 3), (3, 2), (8, 4)])
def test_rank_plans_stay_in_step_and_deal_every_batch_once(world_size, accumulation):
    cfg = CollatorConfig(max_length=8192, batching="packing", batch_size=1, packing_window=64)
    for epoch in range(3):
        order = list(np.random.default_rng(epoch).permutation(600))
        plan = build_plan(order, LENGTHS, cfg)
        shares = [rank_plan(plan, r, world_size, accumulation) for r in range(world_size)]
        steps = steps_per_epoch(len(plan), world_size, accumulation)
        # Every rank: the same number of micro-batches, whole steps of them.
        assert {len(s.batches) for s in shares} == {steps * accumulation}
        assert all(s.steps == steps for s in shares)
        # Real batches: each of the plan's exactly once; fillers only at the end, fewer than a round.
        real = [b for s in shares for b in s.batches[: s.real]]
        assert sorted(real) == sorted(plan)
        assert sum(s.fillers for s in shares) < world_size * accumulation
        assert all(s.batches[s.real:] == [s.batches[s.real - 1]] * s.fillers for s in shares if s.real)


def _steps(plan, world_size, accumulation, start=0):
    """From every rank's micro-batch ``start`` on: each optimizer step's real batches over all ranks
    (fillers left out, as they carry no loss token), and its filler count."""
    shares = [rank_plan(plan, r, world_size, accumulation) for r in range(world_size)]
    steps = []
    for first in range(start, len(shares[0].batches), accumulation):
        span = range(first, first + accumulation)
        steps.append((sorted(s.batches[k] for s in shares for k in span if k < s.real),
                      sum(k >= s.real for s in shares for k in span)))
    return steps


# (saved ranks, accumulation) -> (resumed ranks, accumulation), each pair with the same global batch.
_SAME_GLOBAL_BATCH = [((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 2), (4, 1)), ((4, 1), (1, 4)), ((2, 3), (3, 2)),
                      ((3, 2), (1, 6)), ((1, 6), (6, 1)), ((2, 2), (2, 2))]


@pytest.mark.parametrize("saved,resumed", _SAME_GLOBAL_BATCH, ids=lambda layout: "x".join(map(str, layout)))
@pytest.mark.parametrize("num_batches", [1, 5, 7, 12, 13])
def test_a_position_continues_on_another_rank_layout_of_the_same_global_batch(saved, resumed, num_batches):
    """Resumed at every step boundary of the epoch (its start, the start of the partial last step,
    its end), the new layout trains step for step the batches of the uninterrupted run."""
    plan = [((i,),) for i in range(num_batches)]
    reference = _steps(plan, *saved)
    assert len(reference) == steps_per_epoch(num_batches, *resumed) == -(-num_batches // (saved[0] * saved[1]))
    partial = [step for step, (real, fillers) in enumerate(reference) if fillers]
    assert partial in ([], [len(reference) - 1])  # the epoch-end fillers sit in the last step only
    for step in range(len(reference) + 1):
        consumed = step * saved[1]  # every checkpoint ends an optimizer step
        assert layout_problem(*saved, *resumed, consumed=consumed) == ""
        start = resume_micro_batch(consumed * saved[0], resumed[0])
        assert start == step * resumed[1]
        # The same real batches in each remaining step; the step's micro-batches over all ranks
        # stay the global batch, so the fillers make up the same count.
        assert _steps(plan, *resumed, start=start) == reference[step:]


def test_a_position_inside_an_optimizer_step_stays_on_its_layout():
    assert layout_problem(2, 2, 2, 2, consumed=3) == ""  # the same layout resumes as it always did
    assert layout_problem(2, 2, 4, 1, consumed=3) == (
        "its data position (3 micro-batches per rank) is inside an optimizer step of 2 micro-batches, so it cannot "
        "move onto another rank layout; resume it on 2 ranks (torchrun --nproc_per_node 2) with "
        "training.gradient_accumulation_steps=2")
    with pytest.raises(ValueError, match="6 micro-batches of the epoch done do not divide over 4 ranks"):
        resume_micro_batch(6, 4)


def test_another_global_batch_is_refused_naming_both_layouts_and_the_fix():
    assert layout_problem(2, 1, 1, 1, consumed=4) == (
        "it was saved on 2 ranks x training.gradient_accumulation_steps=1 (2 micro-batches per optimizer step), this "
        "run has 1 rank x 1 (1): the steps after the checkpoint would group the epoch's batches otherwise than the "
        "interrupted run. Set training.gradient_accumulation_steps=2 to keep 2 micro-batches per step on 1 rank")
    # No accumulation keeps 4 micro-batches on 3 ranks: the rank counts that can, and the saved launch.
    said = layout_problem(2, 2, 3, 1, processes_per_rank=2)
    assert said.endswith("4 micro-batches do not divide over 3 ranks: relaunch on a number of ranks N that divides 4 "
                         "(1, 2, 4) with training.gradient_accumulation_steps=4/N, e.g. torchrun --nproc_per_node 4 "
                         "with training.gradient_accumulation_steps=2")
    assert "saved on 2 ranks x training.gradient_accumulation_steps=2 (4 micro-batches per optimizer step)" in said


def test_steps_per_epoch_counts_a_partial_last_step():
    assert steps_per_epoch(13, 2, 2) == 4  # 7 and 6 micro-batches, padded to 8 each
    assert steps_per_epoch(12, 2, 2) == 3 and steps_per_epoch(1, 8, 4) == 1 and steps_per_epoch(0, 2, 2) == 0
    assert [steps_per_epoch(n, 1, 3) for n in (167, 168, 170)] == [56, 56, 57]
    with pytest.raises(ValueError, match="accumulation=0"):
        steps_per_epoch(10, 1, 0)

"""The training data module: per-epoch plans dealt to ranks, filler micro-batches, plan statistics."""

import pytest

from mmtune.data.collator import CollatorConfig
from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
from mmtune.data.datamodule import SFTDataModule
from mmtune.models.base import IGNORE_INDEX


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from mmtune.data.synthetic import generate_synthetic

    return generate_synthetic(tmp_path_factory.mktemp("syn"), n_train=24, n_test=2, n_llava=0, seed=0, image_size=16)


def _module(synthetic, adapter, tmp_path, *, rank=0, world_size=1, accumulation=1, **collator):
    data = DataConfig(mixture=MixtureConfig(sources=[SourceConfig(name="syn", format="mmdu", path=synthetic.train_json,
                                                                  image_root=synthetic.image_dir)]),
                      cache_dir=str(tmp_path / "cache"))
    dm = SFTDataModule(data, CollatorConfig(**collator))
    dm.connect(adapter, rank=rank, world_size=world_size, gradient_accumulation_steps=accumulation)
    dm.setup()
    return dm


def test_stats_on_a_packing_plan(synthetic, adapter, tmp_path):
    dm = _module(synthetic, adapter, tmp_path, batching="packing", batch_size=2, max_length=512)
    stats = dm.stats()
    rows = [row for batch in dm.rank_plan(0).batches for row in batch]
    lengths = dm.lengths.lengths
    assert stats["plan/batches"] == len(dm.rank_plan(0).batches)
    assert stats["plan/real_tokens"] == sum(int(lengths[i]) for row in rows for i in row) == int(lengths.sum())
    assert stats["plan/computed_tokens"] == 512 * len(rows)
    assert 0.5 < stats["plan/utilization"] <= 1.0 and stats["plan/filler_batches"] == 0


def test_ranks_get_equal_whole_steps_and_fillers_train_nothing(synthetic, adapter, tmp_path):
    modules = [_module(synthetic, adapter, tmp_path, rank=r, world_size=2, accumulation=3, batching="padding",
                       batch_size=5) for r in (0, 1)]
    # 24 samples / 5 per batch = 5 batches: 3 and 2 per rank, padded to one step of 3 each.
    assert [m.rank_plan(0).real for m in modules] == [3, 2]
    assert [m.num_micro_batches(0) for m in modules] == [3, 3] and [m.steps_in_epoch(0) for m in modules] == [1, 1]
    served = [list(m.dataloader(0)) for m in modules]
    ids = [i for items in served for _, meta in items for i in meta["ids"]]
    assert len(ids) == len(set(ids)) == 24
    batch, meta = served[1][2]
    assert meta == {"ids": [], "tokens": 0, "images": 0, "filler": True}
    assert int(batch["num_loss_tokens"]) == 0 and bool((batch["labels"] == IGNORE_INDEX).all())
    assert batch["input_ids"].shape == served[1][1][0]["input_ids"].shape  # a real batch's shape, masked
    # Resuming inside the epoch serves the same tail, filler included.
    assert [meta for _, meta in modules[1].dataloader(0, start=1)] == [meta for _, meta in served[1][1:]]


def test_the_main_process_data_position_is_accepted_on_every_rank(synthetic, adapter, tmp_path):
    """The checkpoint records rank 0's data state only; every rank of the resumed run checks it."""
    modules = [_module(synthetic, adapter, tmp_path, rank=r, world_size=2, batching="padding", batch_size=2)
               for r in (0, 1)]
    assert modules[0].rank_plan(0).batches != modules[1].rank_plan(0).batches  # the ranks' shares differ
    saved = modules[0].state_dict(0, consumed=2)
    for module in modules:
        module.check_state(saved)
    changed = _module(synthetic, adapter, tmp_path, rank=1, world_size=2, batching="padding", batch_size=3)
    with pytest.raises(ValueError, match="the batch plan differs"):
        changed.check_state(saved)


def test_a_checkpoint_saved_before_the_whole_plan_hash_still_resumes(synthetic, adapter, tmp_path):
    import hashlib

    modules = [_module(synthetic, adapter, tmp_path, rank=r, world_size=2, batching="padding", batch_size=2)
               for r in (0, 1)]
    rp = modules[0].rank_plan(0)
    old = {"epoch": 0, "consumed": 2, "plan_hash": hashlib.sha1(repr((rp.batches, rp.real)).encode()).hexdigest()[:16],
           "world_size": 2}  # rank 0's share, as written before
    for module in modules:
        module.check_state(old)
        assert module.resume_position(old) == 2
    # Without its accumulation, such a position stays on its own number of ranks.
    one = _module(synthetic, adapter, tmp_path, batching="padding", batch_size=2, accumulation=2)
    with pytest.raises(ValueError, match=r"it was saved on 2 ranks by an mmtune that did not record its gradient "
                                         r"accumulation, so its data position cannot move onto 1 rank\. Relaunch on "
                                         r"2 ranks \(torchrun --nproc_per_node 2\)"):
        one.check_state(old)


def _served(module, start):
    """Per optimizer step, the sorted dialogue ids one rank trains from its micro-batch ``start`` on."""
    metas = [meta for _, meta in module.dataloader(0, start=start)]
    return [sorted(i for meta in metas[k:k + module.accumulation] for i in meta["ids"])
            for k in range(0, len(metas), module.accumulation)]


@pytest.mark.parametrize("saved_format", ["current", "without_global_batch"])
def test_a_position_saved_on_two_ranks_continues_on_one_with_double_accumulation(synthetic, adapter, tmp_path,
                                                                                 saved_format):
    import hashlib

    two = [_module(synthetic, adapter, tmp_path, rank=r, world_size=2, batching="padding", batch_size=5)
           for r in (0, 1)]
    one = _module(synthetic, adapter, tmp_path, batching="padding", batch_size=5, accumulation=2)
    # 24 samples in 5 batches: 3 steps of 2 micro-batches, the last one a real batch and a filler.
    saved = two[0].state_dict(0, consumed=1)
    assert (saved["global_consumed"], saved["global_batch"]) == (2, 2)
    assert one.plan_hash(0) == saved["plan_hash"]  # the same plan and global batch, another layout
    if saved_format == "without_global_batch":  # as written before: the hash of the plan with its layout
        saved = {k: v for k, v in saved.items() if k not in ("global_consumed", "global_batch")}
        saved["plan_hash"] = hashlib.sha1(repr((one._global_plan(0), 2, 1)).encode()).hexdigest()[:16]
    one.check_state(saved)
    assert one.resume_position(saved) == 2
    # The remaining steps train the same samples: one rank's two micro-batches are the two ranks' one each.
    remaining = [sorted(a + b) for a, b in zip(_served(two[0], 1), _served(two[1], 1))]
    assert _served(one, 2) == remaining and len(remaining) == 2
    assert len(remaining[0]) == 10 and len(remaining[1]) == 4  # the partial last step: 4 samples and a filler
    # And back: from one rank onto two, at the start of the partial last step.
    back = one.state_dict(0, consumed=4)
    for module in two:
        module.check_state(back)
        assert module.resume_position(back) == 2


def test_a_data_position_from_another_global_batch_is_refused_naming_both_layouts_and_the_fix(synthetic, adapter,
                                                                                             tmp_path):
    saved = _module(synthetic, adapter, tmp_path, rank=0, world_size=2, batching="padding",
                    batch_size=2).state_dict(0, consumed=2)
    one = _module(synthetic, adapter, tmp_path, batching="padding", batch_size=2)
    with pytest.raises(ValueError, match=r"cannot resume exactly: it was saved on 2 ranks x "
                                         r"training.gradient_accumulation_steps=1 \(2 micro-batches per optimizer "
                                         r"step\), this run has 1 rank x 1 \(1\).* Set "
                                         r"training.gradient_accumulation_steps=2 to keep 2 micro-batches per step "
                                         r"on 1 rank; or start afresh in another training.output_dir"):
        one.check_state(saved)


def test_a_second_launch_reads_the_lengths_back_without_any_setting(synthetic, adapter, tmp_path):
    first = _module(synthetic, adapter, tmp_path, batching="padding", batch_size=2)
    assert not first.lengths.from_cache and (tmp_path / "cache" / "lengths").is_dir()
    second = _module(synthetic, adapter, tmp_path, batching="padding", batch_size=2)
    assert second.lengths.from_cache and second.lengths.lengths.tolist() == first.lengths.lengths.tolist()
    assert second.rank_plan(0).batches == first.rank_plan(0).batches

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

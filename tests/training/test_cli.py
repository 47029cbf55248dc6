"""`mmtune train`: your own files as the sources, formats detected, mixed by ratio; a typo is one line."""

import json
import os

import pytest
from omegaconf import OmegaConf

from mmtune.compose import compose_checked
from mmtune.training import cli
from mmtune.training.config import ConfigError, apply_data_files, to_sft_config


@pytest.fixture
def files(tmp_path):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "imgs" / "red.png")
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"id": "c1", "image": "imgs/red.png", "conversations": [
        {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "red"}]}]))
    pairs = tmp_path / "more" / "chat.jsonl"  # the same file name in another folder
    pairs.parent.mkdir()
    pairs.write_text(json.dumps({"id": "p1", "messages": [
        {"role": "user", "content": [{"type": "image", "path": "red.png"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "red"}]}) + "\n")
    return chat, pairs


def test_data_files_become_the_sources_with_detected_formats_and_ratios(files, tmp_path):
    chat, pairs = files
    raw = compose_checked([f"data.files=[{chat},{pairs}]", f"data.image_root={tmp_path}", "data.ratios=[3,1]"])
    lines = apply_data_files(raw)
    cfg = to_sft_config(raw)
    sources = cfg.data.mixture.sources
    assert [(s.name, s.format, s.path, s.image_root) for s in sources] == [
        ("chat", "llava", str(chat), str(tmp_path)), ("chat_2", "messages", str(pairs), str(tmp_path))]
    assert cfg.data.mixture.weights == {"chat": 3.0, "chat_2": 1.0} and cfg.data.mixture.strategy == "custom"
    assert lines[0].startswith(f"data.files: {chat} -> source 'chat', format llava (detected: ")
    assert lines[1].endswith("ratio 1") and "replaces the data group's sources (synthetic_mmdu, synthetic_llava)" in lines[2]
    # what the run logs and saves in mmtune_run.json is what it trains on
    logged = OmegaConf.to_container(raw, resolve=True)["data"]["mixture"]["sources"]
    assert [s["name"] for s in logged] == ["chat", "chat_2"]


def test_every_unreadable_data_file_is_listed_at_start_up(files, tmp_path):
    chat, _ = files
    odd = tmp_path / "table.csv"
    odd.write_text("a,b\n")
    raw = compose_checked([f"data.files=[{chat},{tmp_path}/gone.json,{odd}]"])
    with pytest.raises(ConfigError) as info:
        to_sft_config(raw)
    message = str(info.value)
    assert f"data.files[1]='{tmp_path}/gone.json' does not exist" in message
    assert f"data.files[2]='{odd}' is not a .json, .jsonl or .parquet file, a folder of shards or a glob" in message
    with pytest.raises(ConfigError, match=r"data.ratios has 1 value\(s\) for 2 data.files"):
        to_sft_config(compose_checked([f"data.files=[{chat},{chat}]", "data.ratios=[1]"]))


def test_the_printed_evaluate_command_uses_the_runs_own_held_out_file(files, tmp_path):
    chat, _ = files
    cfg = to_sft_config(compose_checked([f"data.files=[{chat}]", "eval=heldout", f"eval.heldout.data_path={chat}",
                                         f"training.output_dir={tmp_path}/run"]))
    command, ready = cli.evaluate_command(cfg, tmp_path / "run" / "final")
    assert ready and command == (f"mmtune evaluate checkpoint {tmp_path}/run/final heldout --data {chat} "
                                 f"--out {tmp_path}/run/eval/after --run run")
    # the command's flags are the evaluate CLI's own: it parses as printed
    from mmtune.evaluation.cli import build_parser

    args = build_parser().parse_args(command.split()[2:])
    assert args.benchmark == "heldout" and args.out == f"{tmp_path}/run/eval/after"
    cfg.training.eval_after = True  # training evaluates final/ into eval/after itself: another folder
    assert cli.evaluate_command(cfg, "f")[0].endswith(f"--out {tmp_path}/run/eval/final --run run")
    cfg.eval.heldout.data_path = None
    command, ready = cli.evaluate_command(cfg, "f")
    assert not ready and "heldout --data YOUR_HELD_OUT.jsonl" in command
    assert cli.report_command(cfg) == f"mmtune report --results {tmp_path}/run --out {tmp_path}/run/report"


@pytest.mark.parametrize("args, expected", [
    (["training.epoch=1"], "mmtune train: unknown config key 'training.epoch' (closest: training.epochs)"),
    (["experiment=table5_baseline_2k"], "run it with `mmtune evaluate experiment=table5_baseline_2k`"),
    (["data.files=[nowhere.json]"], "data.files[0]='nowhere.json' does not exist"),
])
def test_mmtune_train_answers_a_bad_command_line_with_one_message(args, expected, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_a_bad_held_out_file_stops_training_with_one_message_not_a_traceback(files, tmp_path, capsys):
    """The evaluation before training reads the held-out file; a record it cannot evaluate
    is the user's file to fix: one message with the data report, exit 2, no traceback."""
    chat, _ = files
    held = tmp_path / "held.json"
    held.write_text(json.dumps([{"id": "h1", "image": "imgs/gone.png", "conversations": [
        {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "red"}]}]))
    code = cli.main(["model=llava_tiny", f"data.files=[{chat}]", f"data.image_root={tmp_path}", "eval=heldout",
                     f"eval.heldout.data_path={held}", f"eval.heldout.image_root={tmp_path}",
                     "training.eval_before=true", "training.max_steps=1", f"training.output_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2
    assert "mmtune train: eval.heldout.data_path=" in err and "cannot be evaluated" in err and "missing_image" in err
    assert "Traceback" not in err


# -- resume safety: the data's content, incomplete checkpoints, links in the run folder ---------

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220)}


@pytest.fixture
def three(tmp_path):
    """``(chat.json with three llava records, image root)``; reversing the records keeps its size."""
    from PIL import Image

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    records = []
    for name, rgb in COLOURS.items():
        Image.new("RGB", (56, 56), rgb).save(imgs / f"{name}.png")
        records.append({"id": name, "image": f"{name}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat color is the picture?"}, {"from": "gpt", "value": name}]})
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps(records))
    return chat, imgs


def _train_args(chat, imgs, out, *extra):
    return ["model=llava_tiny", f"data.files=[{chat}]", f"data.image_root={imgs}", "training.epochs=10",
            "training.max_steps=3", "training.save_every_steps=1", "training.keep_last=3",
            f"training.output_dir={out}", "logging.progress_bar=false", *extra]


def _changed(chat, how):
    """Another data set under the same path: the records reversed (same size, same mtime restored)
    or one record fewer."""
    records, stat = json.loads(chat.read_text()), chat.stat()
    chat.write_text(json.dumps(records[::-1] if how == "same-size-and-time" else records[:2]))
    if how == "same-size-and-time":
        os.utime(chat, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert chat.stat().st_size == stat.st_size and chat.stat().st_mtime_ns == stat.st_mtime_ns


@pytest.mark.parametrize("how", ["same-size-and-time", "a-record-fewer"])
def test_a_data_file_changed_under_its_path_refuses_the_resume_until_allowed_and_is_then_recorded(
        three, tmp_path, capsys, how):
    from mmtune.data.identity import file_identity

    chat, imgs = three
    out = tmp_path / "run"
    args = _train_args(chat, imgs, out, "training.resume=auto")
    assert cli.main(args) == 0
    trained_on = file_identity(chat)
    _changed(chat, how)
    capsys.readouterr()

    assert cli.main(args) == 2  # one message, as every other refusal of the command
    err = capsys.readouterr().err
    key = "data.mixture.sources[0].content"
    assert f"mmtune train: cannot resume from {out / 'checkpoints' / 'step-2'} (step 2)" in err
    assert f"{key}: {trained_on!r} -> {file_identity(chat)!r}" in err
    assert f"""'training.resume_config_changes=["{key}"]'""" in err and "Traceback" not in err

    allowed = [*args, f'training.resume_config_changes=["{key}"]']
    if how == "a-record-fewer":
        # allowed, but the batch plan of other records cannot continue exactly at step 2: one message too
        assert cli.main(allowed) == 2
        err = capsys.readouterr().err
        assert "cannot resume exactly: the batch plan differs" in err and "Traceback" not in err
        return
    assert cli.main(allowed) == 0
    record = json.loads((out / "final" / "mmtune_run.json").read_text())
    assert record["config_changes"] == [{"effective_from_step": 3, "resumed_from": str(out / "checkpoints" / "step-2"),
                                         "changes": {key: {"old": trained_on, "new": file_identity(chat)}}}]


def test_an_incomplete_checkpoint_is_refused_or_passed_over_naming_both(three, tmp_path, capsys):
    chat, imgs = three
    out = tmp_path / "run"
    assert cli.main(_train_args(chat, imgs, out, "training.resume=auto")) == 0
    step1, step2 = out / "checkpoints" / "step-1", out / "checkpoints" / "step-2"
    (step2 / "model.safetensors").unlink()
    (step2 / "optimizer.bin").write_bytes(b"cut")
    capsys.readouterr()

    assert cli.main(_train_args(chat, imgs, out, f"training.resume={step2}")) == 2
    err = capsys.readouterr().err
    assert f"mmtune train: cannot resume: {step2} is incomplete (model.safetensors: missing; optimizer.bin: 3 bytes" \
        in err
    assert f"the newest intact checkpoint of this run is {step1} (step 1)" in err and "Traceback" not in err

    assert cli.main(_train_args(chat, imgs, out)) == 2  # checkpoints there, no resume asked: one message too
    err = capsys.readouterr().err
    assert f"{out} holds an earlier run (checkpoints" in err and "Traceback" not in err

    assert cli.main(_train_args(chat, imgs, out, "training.resume=auto")) == 0
    printed = capsys.readouterr().out
    assert f"{step2} is incomplete (model.safetensors: missing" in printed
    assert f"resuming from the newest intact checkpoint, {step1} (step 1), instead" in printed
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_checkpoint_overwritten_in_place_is_passed_over_and_the_run_resumes_from_the_intact_one(
        three, tmp_path, capsys):
    chat, imgs = three
    out = tmp_path / "run"
    assert cli.main(_train_args(chat, imgs, out)) == 0  # checkpoints at steps 1 and 2, final/ at 3
    step1, step2 = out / "checkpoints" / "step-1", out / "checkpoints" / "step-2"
    weights = step2 / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:  # random bytes in place: names and sizes still agree
        handle.seek(size // 3)
        handle.write(os.urandom(min(65536, size // 3)))
    assert weights.stat().st_size == size
    capsys.readouterr()

    assert cli.main(_train_args(chat, imgs, out, f"training.resume={step2}")) == 2
    err = capsys.readouterr().err
    assert f"mmtune train: cannot resume: {step2} is damaged (model.safetensors: content changed since it was saved" \
        in err and f"the newest intact checkpoint of this run is {step1} (step 1)" in err and "Traceback" not in err

    assert cli.main(_train_args(chat, imgs, out, "training.resume=auto")) == 0
    printed = capsys.readouterr().out
    assert f"{step2} is damaged (model.safetensors: content changed" in printed
    assert f"resumed from {step1}: step 1" in printed
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_second_fresh_run_into_a_used_folder_is_refused_with_the_choices_until_overwrite_is_set(
        three, tmp_path, capsys):
    chat, imgs = three
    out = tmp_path / "run"
    args = _train_args(chat, imgs, out, "training.save_every_steps=null")  # final/ and metrics.jsonl, no checkpoint
    assert cli.main(args) == 0
    first = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "final/model.safetensors")}
    capsys.readouterr()

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"mmtune train: {out} holds an earlier run (final/, metrics.jsonl)" in err and "Traceback" not in err
    assert ("training.resume=auto to continue it; another training.output_dir to keep it; or "
            "training.overwrite_output_dir=true to replace it") in err
    assert {name: (out / name).read_bytes() for name in first} == first  # nothing touched

    assert cli.main([*args, "training.max_steps=2", "training.save_every_steps=1",
                     "training.overwrite_output_dir=true"]) == 0
    assert "training.overwrite_output_dir=true: deleted the earlier run's" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert cli.main([*args, "training.overwrite_output_dir=true", "training.resume=auto"]) == 2
    assert "training.overwrite_output_dir=true with training.resume=auto" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["data_report.json", ".mmtune.lock"])
def test_a_link_planted_in_the_run_folder_is_refused_and_its_target_kept(three, tmp_path, capsys, name):
    chat, imgs = three
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (out / name).symlink_to(victim)
    assert cli.main(_train_args(chat, imgs, out, "training.max_steps=1")) == 2
    err = capsys.readouterr().err
    assert f"mmtune train: {out / name} is a symbolic link (to {victim})" in err and "Traceback" not in err
    assert victim.read_text() == "keep me\n"


def test_data_report_names_the_skipped_records_as_the_data_check_does(three, tmp_path, capsys):
    chat, imgs = three
    records = json.loads(chat.read_text())
    bad = [
        {"id": "no-picture", "image": "gone.png", "conversations": records[0]["conversations"]},
        {"id": "no-answer", "image": "red.png", "conversations": records[0]["conversations"][:1]},
        {"id": "two-placeholders", "image": "red.png", "conversations": [
            {"from": "human", "value": "<image>\n<image>\nWhat color?"}, {"from": "gpt", "value": "red"}]},
    ]
    chat.write_text(json.dumps(records + bad))
    out = tmp_path / "run"
    assert cli.main(_train_args(chat, imgs, out, "training.max_steps=1", "training.save_final=false",
                                "data.validation.mode=skip")) == 0
    source = json.loads((out / "data_report.json").read_text())["sources"][0]
    assert sum(source["skipped"].values()) == 3
    named = [entry for entries in source["skipped_records"].values() for entry in entries]
    assert {entry.split(" ")[0].rstrip(":") for entry in named} == {"no-picture", "no-answer", "two-placeholders"}
    assert any(entry.startswith("no-picture") and "gone.png" in entry for entry in source["skipped_records"]["missing_image"])
    assert "e.g. " in capsys.readouterr().out  # the start-up summary names one too

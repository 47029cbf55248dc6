"""`mmtune train`: your own files as the sources, formats detected, mixed by ratio; a typo is one line."""

import json

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
    assert f"data.files[2]='{odd}' is not a .json or .jsonl file" in message
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

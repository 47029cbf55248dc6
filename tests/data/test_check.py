import json
from pathlib import Path

import pytest
from omegaconf.errors import ConfigKeyError

from mmtune import cli
from mmtune.data.check import main
from mmtune.data.config import configs_dir, load_data_config
from mmtune.data.synthetic import generate_synthetic
from mmtune.data.formats import get_format

DATA_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "data").glob("*.yaml"))


def test_data_configs_exist():
    names = {p.stem for p in DATA_CONFIGS}
    assert {"synthetic", "llava_665k", "mmdu_45k", "add_to_pool", "continue_training"} <= names


@pytest.mark.parametrize("path", DATA_CONFIGS, ids=lambda p: p.stem)
def test_every_data_config_matches_the_schema(path, monkeypatch):
    monkeypatch.setenv("MMTUNE_DATA_ROOT", "/datasets")
    cfg = load_data_config(str(path))
    first = path.read_text().splitlines()[0]
    assert first.startswith("# mmtune data check"), "each config starts with the command that runs it"
    assert all(s.path.startswith("/datasets/") for s in cfg.mixture.sources)
    assert load_data_config(path.stem).mixture.sources[0].name == cfg.mixture.sources[0].name


def test_presets_encode_the_paper_strategies():
    pool = load_data_config("add_to_pool")
    assert pool.mixture.strategy == "add_to_pool"
    assert {s.name: s.num_samples for s in pool.mixture.sources} == {"llava_665k": None, "mmdu_45k": None}
    cont = load_data_config("continue_training", ["mixture.sources.1.num_samples=166000"])
    assert cont.mixture.strategy == "continue_training"
    assert {s.name: s.num_samples for s in cont.mixture.sources} == {"mmdu_45k": None, "llava_665k": 166000}


def test_unknown_key_fails(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mixture:\n  sources: []\n  weigths: {a: 1}\n")
    with pytest.raises(ConfigKeyError, match="weigths"):
        load_data_config(str(bad))
    assert main(["check", str(bad)]) == 2


@pytest.fixture
def synthetic_root(tmp_path, monkeypatch):
    generate_synthetic(tmp_path / "synthetic", n_train=12, n_test=2, n_llava=10)
    monkeypatch.setenv("MMTUNE_DATA_ROOT", str(tmp_path))
    monkeypatch.setenv("MMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_check_prints_the_report(synthetic_root, capsys):
    assert cli.main(["data", "check", "synthetic", "--mixture"]) == 0
    out = capsys.readouterr().out
    assert "source synthetic_mmdu" in out and "records  read 12, kept 12, skipped 0" in out
    assert "source synthetic_llava" in out and "problems none" in out
    assert "samples per epoch" in out
    assert (synthetic_root / "cache" / "data").is_dir()


def test_check_reports_skips_and_strict_failure(synthetic_root, capsys):
    train = synthetic_root / "synthetic" / "train.json"
    records = json.loads(train.read_text())
    records[3]["image"].append("gone.png")
    train.write_text(json.dumps(records))
    # a skipped record fails the check (it gates a pipeline) ...
    assert main(["check", "synthetic"]) == 1
    captured = capsys.readouterr()
    assert "kept 11, skipped 1" in captured.out and "placeholder_mismatch" in captured.out
    assert "e.g. syn-train-000003" in captured.out
    assert "data check: FAILED: 1 of 22 record(s) skipped (placeholder_mismatch 1)" in captured.err
    assert "pass --allow-skips" in captured.err and "train.json: record 'syn-train-000003'" in captured.err
    # ... unless the skips are accepted
    assert main(["check", "synthetic", "--allow-skips"]) == 0
    assert "OK with --allow-skips: 1 of 22 record(s) skipped" in capsys.readouterr().out
    assert main(["check", "synthetic", "--strict"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "train.json: record 'syn-train-000003'" in err and "How to fix" in err
    assert main(["check", "synthetic", "validation.mode=strict", "--refresh"]) == 1
    assert main(["check", "synthetic", "--strict", "--allow-skips"]) == 2
    assert "pass one of the two" in capsys.readouterr().err


def test_strict_reports_every_problem_before_failing(synthetic_root, capsys):
    train = synthetic_root / "synthetic" / "train.json"
    records = json.loads(train.read_text())
    for r in records[:8]:  # more bad records than the report's examples per kind (5)
        r["image"].append("gone.png")
    records[9]["conversations"].append({"from": "user", "value": "And then?"})  # ends with a user turn
    question = len(records[9]["conversations"]) // 2 + 1  # the 1-based exchange of that question
    train.write_text(json.dumps(records))
    assert main(["check", "synthetic"]) == 1
    out = capsys.readouterr().out
    assert out.count("e.g. syn-train-") == 5 + 1  # a few examples per kind
    assert main(["check", "synthetic", "--strict"]) == 1
    out = capsys.readouterr().out
    listed = [line for line in out.splitlines() if "e.g. syn-train-" in line]
    assert len(listed) == 9 and f"e.g. syn-train-000009 turn {question} (question): ends with a user turn" in out
    assert all(f"e.g. syn-train-{i:06d}" in out for i in range(8))


def test_missing_files_and_usage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMTUNE_DATA_ROOT", str(tmp_path))
    assert main(["check", "mmdu_45k", "--cache-dir", str(tmp_path / "c")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert main(["check", "no_such_config"]) == 2
    assert "available:" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert configs_dir().name == "configs"


def _data_file_cases(pics):
    llava = [{"id": "l1", "image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]}]
    mmdu = [{"id": "m1", "image": ["/pics/a.png", "/pics/c.png"], "conversations": [
        {"from": "user", "value": "Image1: <ImageHere> Image2: <ImageHere> Same?"}, {"from": "assistant", "value": "No."}]}]
    xc2 = [{"id": "x1", "image": ["pics/a.png"], "conversations": [
        {"from": "user", "value": "<ImageHere> Colour?"}, {"from": "bot", "value": "Red."}]}]
    messages = [{"id": "c1", "messages": [
        {"role": "user", "content": [{"type": "image", "path": "pics/b.jpg"}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "Green."}]}]
    return {"llava": (llava, pics), "mmdu": (mmdu, pics.parent), "xcomposer2": (xc2, pics.parent),
            "messages": (messages, pics.parent)}


@pytest.mark.parametrize("fmt", ["llava", "mmdu", "xcomposer2", "messages"])
def test_check_a_data_file_detects_and_states_its_format(fmt, tmp_path, pics, capsys):
    records, root = _data_file_cases(pics)[fmt]
    path = tmp_path / (f"{fmt}.jsonl" if fmt == "messages" else f"{fmt}.json")
    path.write_text("".join(json.dumps(r) + "\n" for r in records) if fmt == "messages" else json.dumps(records))
    code = main(["check", str(path), "--image-root", str(root), "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"format {fmt} (detected:" in out and "override with --format" in out
    assert "kept 1, skipped 0" in out
    assert f"joined to {root} and kept inside it" in out


def test_check_a_data_file_format_override_and_missing_image_report(tmp_path, pics, capsys):
    records = [{"id": "m1", "image": ["/mmdu_pics/gone.png"], "conversations": [
        {"from": "user", "value": "<ImageHere> ?"}, {"from": "assistant", "value": "x"}]}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(records))
    code = main(["check", str(path), "--format", "xcomposer2", "--images", "exists",
                 "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert code == 1  # its one record is skipped
    assert "format xcomposer2 (given with --format)" in out
    assert f"tried {tmp_path / 'mmdu_pics' / 'gone.png'}, built as image_root {tmp_path} + rooted path '/mmdu_pics/gone.png'" in out


def test_check_a_data_file_absolute_paths_need_the_flag(tmp_path, pics, capsys):
    inside, outside = tmp_path / "data", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (outside / "a.png").write_bytes((pics / "a.png").read_bytes())
    records = [{"messages": [{"role": "user", "content": [{"type": "image", "path": str(outside / "a.png")}]},
                             {"role": "assistant", "content": "Red."}]},
               {"messages": [{"role": "user", "content": [{"type": "image", "path": str(pics / "a.png")}]},
                             {"role": "assistant", "content": "Red."}]}]
    path = inside / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    main(["check", str(path), "--image-root", str(pics), "--cache-dir", str(tmp_path / "c1")])
    out = capsys.readouterr().out
    assert "kept 1, skipped 1" in out and "path_outside_root" in out and "absolute paths outside it rejected" in out
    main(["check", str(path), "--image-root", str(pics), "--allow-absolute-paths", "--cache-dir", str(tmp_path / "c2")])
    out = capsys.readouterr().out
    assert "kept 2, skipped 0" in out and "absolute paths outside it used as they are" in out


def test_check_a_data_file_with_hostile_records_reports_each_and_a_broken_list_fails(tmp_path, pics, capsys):
    good = {"id": "ok", "image": ["a.png"], "conversations": [
        {"from": "user", "value": "<ImageHere> ?"}, {"from": "assistant", "value": "x"}]}
    elements = [json.dumps(good),
                '{"id": "deep", "conversations": %s}' % ("[" * 50_000 + "]" * 50_000),
                json.dumps({**good, "id": "sur"}).replace('"x"', '"\\ud800"'),
                json.dumps({**good, "id": "nul", "image": ["a\x00.png"]})]
    path = tmp_path / "hostile.json"
    path.write_text("[" + ",\n".join(elements) + "]")
    code = main(["check", str(path), "--image-root", str(pics), "--cache-dir", str(tmp_path / "cache")])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "format mmdu (detected:" in out and "read 4, kept 1, skipped 3" in out
    assert "too_deep 1" in out and "lone_surrogate 1" in out and "invalid_image_path 1" in out
    strict = main(["check", str(path), "--strict", "--image-root", str(pics), "--cache-dir", str(tmp_path / "c2")])
    assert strict == 1 and "record 'deep' (#1): [too_deep]" in capsys.readouterr().err

    path.write_text('[{"id": 1, "conversations": [}]')
    assert main(["check", str(path), "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "line 1, column 30" in err


def test_check_finds_images_too_large_from_their_header(tmp_path, pics, capsys):
    """A 1 x 30000 PNG of under 200 bytes would need a 30000 x 30000 padding canvas: the check
    reports it from the header (nothing is decoded), and strict mode refuses it by name."""
    records = [{"id": "ok", "image": ["a.png"], "conversations": [
                   {"from": "user", "value": "<ImageHere> ?"}, {"from": "assistant", "value": "x"}]},
               {"id": "thin", "image": ["thin.png"], "conversations": [
                   {"from": "user", "value": "<ImageHere> ?"}, {"from": "assistant", "value": "x"}]}]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(records))
    assert main(["check", str(path), "--image-root", str(pics), "--cache-dir", str(tmp_path / "cache")]) == 1
    out = capsys.readouterr().out  # a skipped record fails the check (--allow-skips accepts it)
    assert "kept 1, skipped 1" in out and "image_too_large" in out
    assert "e.g. thin turn 1 (question)" in out and "1 x 30000 px, an aspect ratio of 30000:1" in out
    assert main(["check", str(path), "--image-root", str(pics), "--strict", "--cache-dir", str(tmp_path / "c2")]) == 1
    err = capsys.readouterr().err
    assert "record 'thin' (#1), turn 1 (question): [image_too_large]" in err and "model.image_limits" in err


def test_check_several_data_files_as_training_reads_them(tmp_path, pics, capsys):
    cases = _data_file_cases(pics)
    paths = []
    for fmt in ("llava", "messages"):
        records, _ = cases[fmt]
        path = tmp_path / (f"{fmt}.jsonl" if fmt == "messages" else f"{fmt}.json")
        path.write_text("".join(json.dumps(r) + "\n" for r in records) if fmt == "messages" else json.dumps(records))
        paths.append(str(path))
    # the llava record names a.png relative to pics/, the messages record pics/b.jpg relative to its parent
    code = main(["check", *paths, "--image-root", str(pics.parent), "--cache-dir", str(tmp_path / "cache")])
    captured = capsys.readouterr()
    assert code == 1  # a.png is not under pics.parent itself
    assert f"{paths[0]}: format llava (detected:" in captured.out and f"{paths[1]}: format messages" in captured.out
    assert "source llava " in captured.out and "source messages " in captured.out
    assert "data check: FAILED: 1 of 2 record(s) skipped (missing_image 1)" in captured.err
    assert main(["check", paths[0], "not_a_file.json", "--cache-dir", str(tmp_path / "c")]) == 2
    assert "FILE[1]='not_a_file.json' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("record, expected", [
    ({"id": "a", "dialogue": [{"speaker": "me", "text": "hi"}]},
     "cannot tell the format: expected one of: "),
    ({"id": "a", "conversations": [{"role": "user", "content": "hi"}]},
     "its turns are not {from, value}: the first record's first turn is ['content', 'role']"),
    (["not", "an", "object"], "the first record is a list, not an object"),
])
def test_detection_failure_names_the_keys_expected_and_found(tmp_path, record, expected, capsys):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([record]))
    assert main(["check", str(path), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert expected in err and "mine.json" in err
    if isinstance(record, dict) and "dialogue" in record:
        assert "the first record has keys ['dialogue', 'id']" in err
        # every format's own description of its records, named with the format
        for name in ("llava", "mmdu", "xcomposer2", "messages"):
            assert f"{get_format(name).keys} ({name})" in err
        assert "a 'messages' list of {role, content} (messages)" in err


def test_data_help_lists_its_subcommands(capsys):
    assert cli.main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  check " in out and "  build " in out
    assert main([]) == 2 and "subcommands:" in capsys.readouterr().out


def test_check_with_a_model_measures_the_window_with_and_without_sequence_parallelism(tmp_path, monkeypatch, capsys):
    """``model=... training.sequence_parallel.size=2``: the dialogues over a GPU's share and over
    the whole row, counted and named; those training would skip fail the check unless allowed."""
    from PIL import Image as PILImage

    from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig
    from mmtune.data.encoding import encode_example
    from mmtune.data.mixture import build_mixture
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    monkeypatch.setenv("MMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    PILImage.new("RGB", (32, 32), "red").save(tmp_path / "red.jpg")
    records = [{"id": f"d{k}", "image": ["red.jpg"] if k == 1 else [],
                "conversations": [{"from": "user", "value": ("<ImageHere> " if k == 1 else "") + "q " + "word " * w},
                                  {"from": "assistant", "value": "a " + "word " * w}]}
               for k, w in enumerate([5, 60, 200, 700])]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(records))
    # the lengths the training dataset encodes (template and 16 image tokens included)
    source = SourceConfig(name="chat", format="mmdu", path=str(path))
    dialogues = build_mixture(DataConfig(mixture=MixtureConfig(sources=[source]))).sources[0].dialogues
    adapter = build_adapter(ModelConfig(family="llava"))
    full = [len(encode_example(adapter, d, max_length=None).input_ids) for d in dialogues]
    row = full[2]
    args = ["data", "check", str(path), "model=llava_tiny", f"collator.max_length={row}", "collator.truncation=skip_sample",
            "training.sequence_parallel.size=2"]
    assert cli.main(args) == 1
    captured = capsys.readouterr()
    share = -(-row // 2)
    assert f"without sequence parallelism ({share}-token rows, a GPU's share): " \
           f"{sum(n > share for n in full)} of 4 dialogue(s) longer" in captured.out
    assert f"with sequence parallelism over 2 GPUs ({row}-token rows): 1 of 4 dialogue(s) longer" in captured.out
    assert f"{path} record 'd3' ({full[3]} tokens): skipped (collator.truncation=skip_sample)" in captured.out
    assert "skipped (longer_than_window 1)" in captured.err and "record 'd3'" in captured.err
    assert cli.main([*args, "--allow-skips"]) == 0
    # the row holds all: OK; truncation=error with one too long: refused
    assert cli.main([*args[:4], f"collator.max_length={full[3]}"]) == 0
    assert cli.main([*args[:5], "collator.truncation=error"]) == 1
    assert "training refuses (collator.truncation=error)" in capsys.readouterr().err
    # without a model the check reads the data only; a window key alone asks for one
    assert cli.main(["data", "check", str(path)]) == 0
    assert "window:" not in capsys.readouterr().out
    assert cli.main(["data", "check", str(path), "collator.max_length=64"]) == 2
    assert "add model=NAME or experiment=NAME" in capsys.readouterr().err


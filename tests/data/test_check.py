import json
from pathlib import Path

import pytest
from omegaconf.errors import ConfigKeyError

from mmtune import cli
from mmtune.data.check import main
from mmtune.data.config import configs_dir, load_data_config
from mmtune.data.synthetic import generate_synthetic

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
    assert main(["check", "synthetic"]) == 0
    out = capsys.readouterr().out
    assert "kept 11, skipped 1" in out and "placeholder_mismatch" in out and "e.g. syn-train-000003" in out
    assert main(["check", "synthetic", "--strict"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "train.json: record 'syn-train-000003'" in err and "How to fix" in err
    assert main(["check", "synthetic", "validation.mode=strict", "--refresh"]) == 1


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
    assert code == 0
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
    assert code == 0, out
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
    assert main(["check", str(path), "--image-root", str(pics), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    assert "kept 1, skipped 1" in out and "image_too_large" in out
    assert "e.g. thin turn 0" in out and "1 x 30000 px, an aspect ratio of 30000:1" in out
    assert main(["check", str(path), "--image-root", str(pics), "--strict", "--cache-dir", str(tmp_path / "c2")]) == 1
    err = capsys.readouterr().err
    assert "record 'thin' (#1), turn 0: [image_too_large]" in err and "model.image_limits" in err

"""Data loss is visible: skipped records, samples fitting no window, truncation and corrupt images, per source."""

import io
import json

import numpy as np
import pytest
from PIL import Image as PILImage

from mmtune.data.collator import CollatorConfig
from mmtune.data.config import DataConfig, MixtureConfig, SourceConfig, ValidationConfig
from mmtune.data.datamodule import SFTDataModule
from mmtune.data.images import CorruptImageError
from mmtune.data.validation import ImageChecker


def _truncated_jpeg(path):
    """A JPEG whose header is fine and whose pixel data stops half way."""
    buffer = io.BytesIO()
    PILImage.fromarray((np.random.default_rng(0).random((48, 48, 3)) * 255).astype("uint8")).save(buffer, "JPEG")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    return path


def _record(rid, images, turns=1, words=3):
    conv = []
    for t in range(turns):
        marks = "<ImageHere> " * (len(images) if t == 0 else 0)
        conv += [{"from": "user", "value": f"{marks}question {t} " + "word " * words},
                 {"from": "assistant", "value": f"answer {t} " + "word " * words}]
    return {"id": rid, "image": images, "conversations": conv}


@pytest.fixture
def data_dir(tmp_path):
    pics = tmp_path / "pics"
    pics.mkdir()
    PILImage.new("RGB", (32, 32), "red").save(pics / "good.jpg")
    _truncated_jpeg(pics / "cut.jpg")
    return tmp_path


def _module(adapter, tmp_path, sources, *, mode="skip", check="verify", max_length=512, image_errors=None):
    cfg = DataConfig(mixture=MixtureConfig(sources=sources), validation=ValidationConfig(mode=mode, check_images=check),
                     cache_dir=str(tmp_path / "cache"))
    dm = SFTDataModule(cfg, CollatorConfig(max_length=max_length, batch_size=1, image_errors=image_errors))
    dm.connect(adapter)
    return dm


def _source(tmp_path, name, records):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(records))
    return SourceConfig(name=name, format="mmdu", path=str(path), image_root=str(tmp_path / "pics"))


def test_verify_passes_a_cut_jpeg_that_decode_finds(data_dir):
    cut = str(data_dir / "pics" / "cut.jpg")
    assert ImageChecker("verify").check(cut) is None
    code, detail = ImageChecker("decode").check(cut)
    assert code == "corrupt_image" and "truncated" in detail


def test_skip_mode_skips_an_image_that_fails_to_decode_and_reports_it(adapter, data_dir):
    records = [_record("ok", ["good.jpg"]), _record("cut", ["cut.jpg"]), _record("ok2", ["good.jpg"])]
    dm = _module(adapter, data_dir, [_source(data_dir, "s", records)])
    dm.setup()
    assert dm.collator_config.image_errors == "skip"  # follows data.validation.mode
    seen = []
    for batch, meta in dm.dataloader(0):  # batch_size 1: one micro-batch is only the cut sample
        dm.note_skipped(meta)
        seen += meta["ids"]
        assert batch["input_ids"].shape[0] == 1
    assert sorted(seen) == ["ok", "ok2"]
    dm.merge_skipped(dm.skipped_items)
    report = dm.loss_report
    assert report.corrupt_images == 1
    assert "cut: " in report.sources[0].corrupt_examples[0] and "cut.jpg" in report.sources[0].corrupt_examples[0]
    assert "1 samples left out during training because an image failed to decode" in report.render_skipped()


def test_strict_mode_stops_naming_file_record_turn_and_the_setting(adapter, data_dir):
    records = [_record("cut", ["cut.jpg"])]
    dm = _module(adapter, data_dir, [_source(data_dir, "s", records)], mode="strict")
    dm.setup()
    with pytest.raises(CorruptImageError, match=r"cut\.jpg.*dialogue 'cut', turn 1 \(question\).*data\.validation\.mode=skip"):
        list(dm.dataloader(0))
    dm = _module(adapter, data_dir, [_source(data_dir, "s2", records)], mode="strict", check="decode")
    with pytest.raises(Exception, match=r"record 'cut' \(#0\), turn 1 \(question\): \[corrupt_image\]"):
        dm.setup()  # the decode level finds it before training


def test_start_up_report_counts_losses_per_source(adapter, data_dir):
    long = [_record(f"long{i}", [], turns=8, words=4) for i in range(2)]
    huge = [_record("huge", [], turns=1, words=400)]
    broken = [{"id": "nope", "conversations": "not a list"}]
    dm = _module(adapter, data_dir, [_source(data_dir, "a", long + huge + broken),
                                      _source(data_dir, "b", [_record("short", ["good.jpg"])])], max_length=256)
    dm.setup()
    a, b = dm.loss_report.sources
    assert (a.records_read, a.records_kept, a.skipped) == (4, 3, {"malformed_record": 1})
    assert a.no_window == 1 and a.no_window_ids == ["huge"]
    assert a.truncated == 2 and a.dropped_turns > 0
    assert (b.no_window, b.truncated, b.dropped_turns) == (0, 0, 0)
    text = dm.loss_report.render()
    assert "a: records read 4, kept 3; skipped malformed_record 1 (e.g. nope: " in text
    huge_tokens = int(dm.lengths.full_lengths[2])
    assert huge_tokens > 256 and a.no_window_examples == [f"'huge' ({huge_tokens} tokens)"]
    assert f"; 1 samples fit no window (e.g. {data_dir / 'a.json'} record 'huge' ({huge_tokens} tokens))" in text
    # the skipped records are named, not only counted, as `mmtune data check` names them
    assert list(a.skipped_records) == ["malformed_record"] and a.skipped_records["malformed_record"][0].startswith("nope")
    dm.loss_report.write(str(data_dir / "data_report.json"))
    written = json.loads((data_dir / "data_report.json").read_text())["sources"][0]
    assert written["skipped_records"] == a.skipped_records
    assert f"2 samples truncated: {a.dropped_turns} turns" in text
    assert dm.loss_report.trainable_samples == 3


def test_a_run_whose_data_all_got_dropped_says_why(adapter, data_dir):
    dm = _module(adapter, data_dir, [_source(data_dir, "gone", [{"id": "x", "conversations": []}]),
                                      _source(data_dir, "big", [_record("huge", [], words=400)])], max_length=128)
    with pytest.raises(ValueError) as err:
        dm.setup()
    message = str(err.value)
    assert "no training sample is left" in message
    assert "source gone: all 1 records were skipped when reading (empty_conversation 1)" in message
    assert "source big: all 1 samples are longer than the 128-token window" in message and "huge" in message


def test_dialogues_longer_than_the_row_are_named_with_file_and_record_then_skipped_or_refused(adapter, data_dir):
    """At data loading: ``skip_sample`` leaves them out, each named with its file; ``error``
    refuses the run naming every one (not only the first), with the sequence-parallel row in the fix."""
    from mmtune.data.truncation import SampleTooLongError

    records = [_record("fits", []), _record("long1", [], words=300), _record("fits2", ["good.jpg"]),
               _record("long2", ["good.jpg"], words=500)]
    skip = _module(adapter, data_dir, [_source(data_dir, "chat", records)], max_length=256)
    skip.collator_config.truncation = "skip_sample"
    skip.setup()
    (loss,) = skip.loss_report.sources
    lengths = skip.lengths.full_lengths.tolist()
    assert lengths[1] > 256 and lengths[3] > 256 and max(lengths[0], lengths[2]) <= 256
    assert loss.no_window == 2 and loss.no_window_ids == ["long1", "long2"] and loss.path == str(data_dir / "chat.json")
    assert f"record 'long1' ({lengths[1]} tokens), 'long2' ({lengths[3]} tokens)" in skip.loss_report.render()
    assert skip.loss_report.trainable_samples == 2

    refuse = _module(adapter, data_dir, [_source(data_dir, "chat", records)], max_length=256)
    refuse.collator_config.truncation = "error"
    with pytest.raises(SampleTooLongError) as err:
        refuse.setup()
    message = str(err.value)
    assert message.startswith("2 dialogue(s) longer than collator.max_length=256 tokens")
    for rid, tokens in (("long1", lengths[1]), ("long2", lengths[3])):
        assert f"{data_dir / 'chat.json'} record {rid!r} ({tokens} tokens)" in message
    assert "training.sequence_parallel.size" in message and "'fits'" not in message

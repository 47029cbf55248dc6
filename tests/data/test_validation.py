"""Every problem class, in skip mode (counted, record left out) and strict mode (raised)."""

import json

import pytest

from mmtune.data.config import SourceConfig
from mmtune.data.dialogue import Dialogue, Image, Turn
from mmtune.data.readers import load_source
from mmtune.data.validation import (
    PROBLEMS,
    DataValidationError,
    ImageChecker,
    TextLimits,
    ValidationReport,
    check_dialogue,
    turn_label,
)


def _user(v):
    return {"from": "user", "value": v}


def _asst(v):
    return {"from": "assistant", "value": v}


GOOD = {"id": "good", "image": ["a.png"], "conversations": [_user("Image1: <ImageHere>. Colour?"), _asst("Red.")]}

# code -> (bad record, position of the message the strict error must name, or None)
MMDU_CASES = {
    "placeholder_mismatch": ({"id": "bad", "image": ["a.png", "c.png"], "conversations": [_user("<ImageHere> ?"), _asst("x")]}, None),
    "missing_image": ({"id": "bad", "image": ["nope.png"], "conversations": [_user("<ImageHere> ?"), _asst("x")]}, 0),
    "corrupt_image": ({"id": "bad", "image": ["a.png", "broken.png"], "conversations": [
        _user("<ImageHere> ?"), _asst("x"), _user("<ImageHere> ?"), _asst("y")]}, 2),
    "empty_conversation": ({"id": "bad", "conversations": []}, None),
    "empty_turn": ({"id": "bad", "conversations": [_user("Hi"), _asst("  ")]}, 1),
    "unknown_role": ({"id": "bad", "conversations": [_user("Hi"), {"from": "narrator", "value": "x"}]}, 1),
    "placeholder_in_assistant": ({"id": "bad", "image": ["a.png"], "conversations": [_user("Hi"), _asst("<ImageHere>")]}, 1),
    "malformed_record": ({"id": "bad", "conversations": [_user("Hi"), {"from": "assistant"}]}, 1),
    "duplicate_id": ({"id": "good", "conversations": [_user("Hi"), _asst("Hello")]}, None),
    "path_outside_root": ({"id": "bad", "image": ["a.png", "../outside.png"], "conversations": [
        _user("<ImageHere> ?"), _asst("x"), _user("<ImageHere> ?"), _asst("y")]}, 2),
    # 1 x 30000 px: an aspect ratio far above model.image_limits, found from the header
    "image_too_large": ({"id": "bad", "image": ["a.png", "thin.png"], "conversations": [
        _user("<ImageHere> ?"), _asst("x"), _user("<ImageHere> ?"), _asst("y")]}, 2),
}
ROLE_ORDER_CASES = {
    "two user turns in a row": ([_user("a"), _user("b"), _asst("c")], 1),
    "starts with assistant": ([_asst("a"), _user("b")], 0),
    "ends with a user turn": ([_user("a"), _asst("b"), _user("c")], 2),
}


def _check_both_modes(path, fmt, image_root, cache_dir, code, turn, n_good=1, record_id="bad", **read):
    cfg = SourceConfig(name="s", format=fmt, path=str(path), image_root=str(image_root))
    src = load_source(cfg, mode="skip", cache_dir=cache_dir, **read)
    r = src.report
    assert r.problems == {code: 1}
    assert r.skipped == {code: 1}
    assert (r.records_read, r.records_kept, r.records_skipped) == (n_good + 1, n_good, 1)
    assert len(src.dialogues) == n_good
    assert r.examples[code] and r.examples[code][0].startswith(record_id)
    rendered = r.render()
    assert code in rendered and PROBLEMS[code][1] in rendered and f"e.g. {record_id}" in rendered

    with pytest.raises(DataValidationError) as e:
        load_source(cfg, mode="strict", cache_dir=cache_dir + "-strict", **read)
    msg = str(e.value)
    assert str(path) in msg and f"record {record_id!r}" in msg and f"[{code}]" in msg and "How to fix:" in msg
    if turn is not None:  # named as the viewer numbers turns: 1-based exchange and its side
        assert f"{turn_label(turn)}:" in msg and f"{record_id} {turn_label(turn)}" in r.examples[code][0]
    # The cached skip-mode entry also refuses strict mode, naming the same problem.
    with pytest.raises(DataValidationError, match=rf"\[{code}\]"):
        load_source(cfg, mode="strict", cache_dir=cache_dir, **read)


@pytest.mark.parametrize("code", sorted(MMDU_CASES))
def test_problem_class_in_skip_and_strict_mode(code, tmp_path, pics, cache_dir, write_json):
    bad, turn = MMDU_CASES[code]
    path = write_json(tmp_path / "d.json", [GOOD, bad])
    _check_both_modes(path, "mmdu", pics, cache_dir, code, turn, record_id=bad["id"])


@pytest.mark.parametrize("case", sorted(ROLE_ORDER_CASES))
def test_role_order_variants(case, tmp_path, pics, cache_dir, write_json):
    turns, turn = ROLE_ORDER_CASES[case]
    path = write_json(tmp_path / "d.json", [GOOD, {"id": "bad", "conversations": turns}])
    _check_both_modes(path, "mmdu", pics, cache_dir, "role_order", turn)
    src = load_source(SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics)), cache_dir=cache_dir)
    assert case in src.report.examples["role_order"][0]


def test_invalid_json_and_non_utf8_lines_in_jsonl(tmp_path, pics, cache_dir):
    good = b'{"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    path = tmp_path / "chat.jsonl"
    path.write_bytes(good + b'{"id": "x", "messages": [\n')
    _check_both_modes(path, "messages", pics, cache_dir, "invalid_json", None, record_id="line 2")
    path2 = tmp_path / "chat2.jsonl"
    path2.write_bytes(good + good.replace(b'"ok"', b'"caf\xe9"'))
    _check_both_modes(path2, "messages", pics, cache_dir + "2", "non_utf8", None, record_id="line 2")


def test_non_utf8_inside_a_json_list_skips_only_that_record(tmp_path, pics, cache_dir):
    path = tmp_path / "latin.json"
    path.write_bytes(b'[{"id": "good", "conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]},\n'
                     b' {"id": "bad", "conversations": [{"from": "user", "value": "caf\xe9"}, {"from": "assistant", "value": "yo"}]}]')
    _check_both_modes(path, "mmdu", pics, cache_dir, "non_utf8", None)


def test_several_problems_counted_per_class_and_skips_add_up(tmp_path, pics, cache_dir, write_json):
    records = [GOOD]
    records.append({"id": "two", "image": ["nope.png"], "conversations": [_asst("<ImageHere>"), _user("b")]})
    for i in range(7):
        records.append({"id": f"m{i}", "image": [f"missing{i}.png"], "conversations": [_user("<ImageHere>"), _asst("x")]})
    path = write_json(tmp_path / "d.json", records)
    src = load_source(SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics)),
                      cache_dir=cache_dir, max_examples=3)
    r = src.report
    # "two" shows three classes; it is skipped once, under its first problem.
    assert r.problems == {"missing_image": 8, "placeholder_in_assistant": 1, "role_order": 1}
    assert sum(r.skipped.values()) == r.records_skipped == 8
    assert r.records_kept == 1 and len(r.examples["missing_image"]) == 3
    assert ValidationReport.from_dict(r.to_dict()) == r


def test_image_checks_are_configurable(tmp_path, pics, cache_dir, write_json):
    bad, _ = MMDU_CASES["corrupt_image"]
    path = write_json(tmp_path / "d.json", [GOOD, bad])
    cfg = SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics))
    assert load_source(cfg, mode="strict", cache_dir=cache_dir, check_images="exists").report.ok
    missing, _ = MMDU_CASES["missing_image"]
    path = write_json(tmp_path / "d.json", [GOOD, missing])
    assert load_source(cfg, mode="strict", cache_dir=cache_dir, check_images="none").report.records_kept == 2


def test_check_dialogue_directly_and_image_checker_caches(pics):
    d = Dialogue("d", "s", (Turn("system", ("Be brief.",)), Turn("user", (Image(str(pics / "a.png")), "?")), Turn("assistant", ("red",))))
    assert check_dialogue(d, 0, ImageChecker("verify")) == []
    only_system = Dialogue("e", "s", (Turn("system", ("x",)),))
    assert [p.code for p in check_dialogue(only_system, 0)] == ["empty_conversation"]
    checker = ImageChecker("verify")
    assert checker.check(str(pics / "broken.png"))[0] == "corrupt_image"
    (pics / "broken.png").unlink()
    assert checker.check(str(pics / "broken.png"))[0] == "corrupt_image"  # answered from the per-path memo


# Every lone half of a UTF-16 surrogate pair, at both ends of both halves' ranges.
LONE_ESCAPES = ["\\ud800", "\\udbff", "\\udc00", "\\udfff"]


def _with_text(text_json: str, rid: str = "bad") -> str:
    """One MMDU record whose second turn's value is ``text_json`` (raw JSON string text)."""
    return ('{"id": "%s", "conversations": [{"from": "user", "value": "Hi"}, '
            '{"from": "assistant", "value": %s}]}' % (rid, text_json))


@pytest.mark.parametrize("escape", LONE_ESCAPES)
@pytest.mark.parametrize("layout", ["json", "jsonl"])
def test_a_lone_surrogate_escape_skips_only_its_record(escape, layout, tmp_path, pics, cache_dir):
    good = json.dumps(GOOD)
    bad = _with_text(f'"a{escape}b"')
    path = tmp_path / f"d.{layout}"
    path.write_text(f"[{good},\n{bad}]" if layout == "json" else f"{good}\n{bad}\n")
    _check_both_modes(path, "mmdu", pics, cache_dir, "lone_surrogate", 1)
    report = load_source(SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics)),
                         cache_dir=cache_dir).report
    assert f"conversations[1].value holds {escape}" in report.examples["lone_surrogate"][0]
    report.render().encode("utf-8")  # printable


@pytest.mark.parametrize("where", ["id", "key", "unused field"])
def test_a_lone_surrogate_anywhere_in_the_record_is_named_printably(where, tmp_path, pics, cache_dir):
    bad = {"id": '"caf\\ud800"', "key": '"bad", "\\udfffkey": 1', "unused field": '"bad", "note": "\\udc00"'}[where]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + _with_text('"fine"', "X").replace('"X"', bad) + "\n")
    src = load_source(SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics)), cache_dir=cache_dir)
    assert src.report.skipped == {"lone_surrogate": 1} and src.report.records_kept == 1
    example = src.report.examples["lone_surrogate"][0]
    assert {"id": "caf\\ud800: id holds \\ud800", "key": "bad: key '\\udfffkey' holds \\udfff",
            "unused field": "bad: note holds \\udc00"}[where] in example
    src.report.render().encode("utf-8")


def test_surrogate_pairs_and_escaped_backslashes_are_text(tmp_path, pics, cache_dir):
    # A high+low pair is one character (what json.dumps writes for an emoji); "\\ud800" is
    # a backslash followed by "ud800". Neither is a problem.
    records = [_with_text('"\\ud83d\\ude00"', "pair"), _with_text('"\\\\ud800"', "backslash")]
    path = tmp_path / "d.json"
    path.write_text("[" + ",".join(records) + "]")
    src = load_source(SourceConfig(name="s", format="mmdu", path=str(path)), cache_dir=cache_dir, mode="strict")
    assert [d.turns[1].segments for d in src.dialogues] == [("\U0001f600",), ("\\ud800",)]


def _deep(depth: int, kind: str) -> str:
    opener, closer = {"list": ("[", "]"), "object": ('{"a": ', "}")}[kind]
    return opener * depth + "1" + closer * depth


@pytest.mark.parametrize("kind", ["list", "object"])
@pytest.mark.parametrize("layout", ["json", "jsonl"])
def test_nesting_deeper_than_the_parser_skips_only_that_record(kind, layout, tmp_path, pics, cache_dir):
    # The id comes after the deep part: it is still found for the report.
    bad = '{"x": %s, "id": "bad", "conversations": []}' % _deep(100_000, kind)
    good = json.dumps(GOOD)
    path = tmp_path / f"d.{layout}"
    path.write_text(f"[{good},\n{bad}]" if layout == "json" else f"{good}\n{bad}\n")
    _check_both_modes(path, "mmdu", pics, cache_dir, "too_deep", None,
                      record_id="bad" if layout == "json" else "line 2")


@pytest.mark.parametrize("fmt", ["llava", "mmdu", "messages"])
def test_a_nul_byte_in_an_image_path_skips_only_that_record(fmt, tmp_path, pics, cache_dir):
    good_path, bad_path = "a.png", "a\x00.png"
    records = {
        "llava": lambda rid, p: {"id": rid, "image": p, "conversations": [
            {"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}]},
        "mmdu": lambda rid, p: {"id": rid, "image": [p], "conversations": [_user("<ImageHere> ?"), _asst("Red.")]},
        "messages": lambda rid, p: {"id": rid, "messages": [
            {"role": "user", "content": [{"type": "image", "path": p}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "Red."}]},
    }[fmt]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(records("good", good_path)) + "\n" + json.dumps(records("bad", bad_path)) + "\n")
    _check_both_modes(path, fmt, pics, cache_dir, "invalid_image_path", 0)


def test_a_jsonl_line_over_the_record_size_limit_skips_only_that_record(tmp_path, pics, cache_dir):
    good = json.dumps(GOOD)
    path = tmp_path / "d.jsonl"
    path.write_text(f"{good}\n" + json.dumps({"id": "bad", "t": "x" * 4 * len(good)}) + "\n")
    _check_both_modes(path, "mmdu", pics, cache_dir, "record_too_large", None, record_id="line 2",
                      max_record_bytes=2 * len(good))


def test_every_problem_class_is_covered_by_a_test():
    covered = set(MMDU_CASES) | {"role_order", "invalid_json", "non_utf8", "lone_surrogate", "too_deep",
                                 "invalid_image_path", "record_too_large", "text_too_long", "field_too_long",
                                 "unreadable_shard"}  # tests/data/test_tables.py
    assert covered == set(PROBLEMS)


def test_non_utf8_id_is_reported_printably(tmp_path, pics, cache_dir):
    path = tmp_path / "latin.json"
    path.write_bytes(b'[{"id": "caf\xe9", "conversations": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "yo"}]}]')
    report = load_source(SourceConfig(name="s", format="mmdu", path=str(path)), cache_dir=cache_dir).report
    assert report.skipped == {"non_utf8": 1} and report.records_kept == 0
    report.render().encode("utf-8")  # printable: no lone surrogates left
    assert "caf\\udce9" in report.examples["non_utf8"][0]


def test_image_limits_are_the_callers_and_part_of_the_cache_entry(tmp_path, pics, cache_dir, write_json):
    from mmtune.core.images import ImageLimits

    bad, _ = MMDU_CASES["image_too_large"]
    path = write_json(tmp_path / "d.json", [GOOD, bad])
    cfg = SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics))
    report = load_source(cfg, cache_dir=cache_dir).report
    assert report.skipped == {"image_too_large": 1}
    assert "aspect ratio of 30000:1" in report.examples["image_too_large"][0]
    assert "model.image_limits.max_aspect_ratio=200" in report.examples["image_too_large"][0]
    # a run that expects such images raises the limits; the cached report of the old limits is not reused
    wide = ImageLimits(max_side=30000, max_aspect_ratio=30000)
    assert load_source(cfg, cache_dir=cache_dir, image_limits=wide, mode="strict").report.records_kept == 2
    # the area limit holds on its own: 1 x 30000 is 30000 pixels
    with pytest.raises(DataValidationError, match=r"turn 2 \(question\): \[image_too_large\].*max_pixels=20000"):
        load_source(cfg, cache_dir=cache_dir, mode="strict",
                    image_limits=ImageLimits(max_side=30000, max_aspect_ratio=30000, max_pixels=20000))
    # "exists" opens no file, so it checks no size either
    assert load_source(cfg, cache_dir=cache_dir, check_images="exists").report.records_kept == 2


@pytest.mark.parametrize("system", [False, True])
def test_turns_are_numbered_by_exchange_from_one_with_a_system_message_left_out(system):
    # message positions 0..5 of a record, with or without a system message in front
    offset = int(system)
    labels = [turn_label(i + offset, system) for i in range(6)]
    assert labels == ["turn 1 (question)", "turn 1 (answer)", "turn 2 (question)", "turn 2 (answer)",
                      "turn 3 (question)", "turn 3 (answer)"]
    assert turn_label(0, True) == "system message" and turn_label(None) == ""


def test_a_problem_after_a_system_message_names_the_exchange_the_viewer_shows(tmp_path, pics, cache_dir):
    records = [
        {"id": "good", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
        {"id": "bad", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                   {"role": "user", "content": [{"type": "image", "path": "gone.png"}]},
                                   {"role": "assistant", "content": "c"}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    src = load_source(SourceConfig(name="s", format="messages", path=str(path), image_root=str(pics)),
                      mode="skip", cache_dir=cache_dir, check_images="exists")
    assert src.report.examples["missing_image"][0].startswith("bad turn 2 (question): tried ")


# -- oversized fields: left out before anything tokenises them ------------------------------------

LIMITS = TextLimits(max_turn_chars=200, max_record_chars=500)
OVERSIZED = {  # case -> (bad record, code, turn named, read settings)
    "a question over the turn limit": (
        {"id": "bad", "conversations": [_user("q" * 201), _asst("a")]}, "text_too_long", 0, LIMITS),
    "an answer over the turn limit": (
        {"id": "bad", "conversations": [_user("q"), _asst("a"), _user("q"), _asst("a" * 201)]}, "text_too_long", 3,
        LIMITS),
    "a record over the record limit": (
        {"id": "bad", "conversations": [_user("q" * 150), _asst("a" * 150)] * 2}, "text_too_long", None, LIMITS),
    "a turn over the default limit": (
        {"id": "bad", "conversations": [_user("q" * (TextLimits().max_turn_chars + 1)), _asst("a")]}, "text_too_long",
        0, None),
    "a role of 2000 characters": (
        {"id": "bad", "conversations": [_user("q"), {"from": "r" * 2000, "value": "a"}]}, "field_too_long", 1, None),
    "an image path of 5000 characters": (
        {"id": "bad", "image": ["p" * 5000 + ".png"], "conversations": [_user("<ImageHere> ?"), _asst("a")]},
        "field_too_long", 0, None),
}


@pytest.mark.parametrize("case", list(OVERSIZED))
def test_an_oversized_field_skips_only_its_record_in_skip_and_strict_mode(case, tmp_path, pics, cache_dir,
                                                                            write_json):
    bad, code, turn, limits = OVERSIZED[case]
    path = write_json(tmp_path / "d.json", [GOOD, bad])
    _check_both_modes(path, "mmdu", pics, cache_dir, code, turn, **({"text_limits": limits} if limits else {}))


def test_an_oversized_id_is_named_clipped(tmp_path, pics, cache_dir, write_json):
    bad = {"id": "x" * 50_000, "conversations": [_user("q"), _asst("a")]}
    path = write_json(tmp_path / "d.json", [GOOD, bad])
    report = load_source(SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics)),
                         cache_dir=cache_dir).report
    assert report.skipped == {"field_too_long": 1}
    assert report.examples["field_too_long"] == ["x" * 80 + "... (50000 characters): id of 50000 characters"]
    assert len(report.first_problem) < 1000


@pytest.mark.parametrize("fmt, bad", [
    ("llava", {"id": "bad", "conversations": [{"from": "human", "value": "q" * 201}, {"from": "gpt", "value": "a"}]}),
    ("messages", {"id": "bad", "messages": [{"role": "user", "content": "q"}, {"role": "assistant",
                                                                               "content": "a" * 201}]}),
])
def test_the_text_limits_hold_for_every_format(fmt, bad, tmp_path, cache_dir, write_json):
    path = write_json(tmp_path / "d.json", [bad])
    report = load_source(SourceConfig(name="s", format=fmt, path=str(path)), cache_dir=cache_dir,
                         check_images="none", text_limits=LIMITS).report
    assert report.skipped == {"text_too_long": 1} and report.records_kept == 0


def test_the_text_limits_are_part_of_the_cache_entry(tmp_path, pics, cache_dir, write_json):
    path = write_json(tmp_path / "d.json", [GOOD, {"id": "long", "conversations": [_user("q" * 300), _asst("a")]}])
    cfg = SourceConfig(name="s", format="mmdu", path=str(path), image_root=str(pics))
    assert load_source(cfg, cache_dir=cache_dir, text_limits=LIMITS).report.records_kept == 1
    assert load_source(cfg, cache_dir=cache_dir).report.records_kept == 2  # the defaults: another entry

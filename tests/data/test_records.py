"""Records of JSON lists (read as a stream) and JSONL files (no line held past the record-size limit)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmtune.data.records import iter_json_array, iter_jsonl, iter_records
from mmtune.data.validation import DataValidationError

ROOT = Path(__file__).resolve().parents[2]


def test_json_array_streaming_matches_json_load_across_chunk_boundaries(tmp_path):
    records = [{"id": i, "t": "ünïcode ✓ " * (i % 5), "nested": [{"a": [1, 2, {"b": "]},["}]}]} for i in range(50)]
    path = tmp_path / "a.json"
    path.write_text(" \n" + json.dumps(records, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    for chunk in (3, 17, 1000, 1 << 20):
        got = list(iter_json_array(str(path), chunk_chars=chunk))
        assert [v for _, v, _ in got] == records
        assert [i for i, _, _ in got] == list(range(50))
        assert all(p is None for _, _, p in got)
    (tmp_path / "numbers.json").write_text("[1, 23456, 789]")
    for chunk in (2, 3, 5):
        assert [v for _, v, _ in iter_json_array(str(tmp_path / "numbers.json"), chunk_chars=chunk)] == [1, 23456, 789]
    (tmp_path / "empty.json").write_text("[ ]")
    assert list(iter_records(str(tmp_path / "empty.json"))) == []


def test_broken_json_list_raises_with_line(tmp_path):
    # Breaks in the list's own structure: no safe way to find where the next record starts.
    path = tmp_path / "broken.json"
    for text, line, element in [
        ('[\n{"id": 1},\n{"id": 2},, {"x": 3},\n{"id": 4}\n]', 3, 2),  # between elements
        ('[\n{"id": 1},\n{"id": 2, "x": [3}},\n{"id": 4}\n]', 3, 1),  # brackets do not pair
        ('[\n{"id": 1},\n{"id": "2, "x": 3},\n{"id": "4"}\n]', 3, 1),  # a stray quote: strings cross lines
        ('[\n{"id": 1},\n  tru,\n{"id": 4}\n]', 3, 1),  # a broken scalar element
    ]:
        path.write_text(text)
        with pytest.raises(DataValidationError, match=rf"broken.json: invalid JSON at line {line}.*element #{element}"):
            list(iter_json_array(str(path), chunk_chars=4))
    path.write_text('[{"id": 1}, {"id": 2}')
    with pytest.raises(DataValidationError, match="missing"):
        list(iter_json_array(str(path)))
    path.write_text('[{"id": 1}, {"id": 2, "x": [[[')
    with pytest.raises(DataValidationError, match="element #1"):
        list(iter_json_array(str(path)))
    path.write_text('{"id": 1}\n')  # JSONL is not mistaken for a list
    assert [v for _, v, _ in iter_records(str(path))] == [{"id": 1}]


def test_json_list_element_broken_inside_its_brackets_is_skipped_alone(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n{"id": 1},\n{"x": [1 2], "id": "two",, "y": "]"},\n{"id": 3}\n]')
    for chunk in (4, 11, 1 << 20):
        got = list(iter_json_array(str(path), chunk_chars=chunk))
        assert [(i, v) for i, v, _ in got] == [(0, {"id": 1}), (1, None), (2, {"id": 3})]
        problem = got[1][2]
        assert (problem.code, problem.record_id, problem.record_index) == ("invalid_json", "two", 1)
        assert "at line 3, column 10" in problem.detail
        assert "spans line 3, column 1 to line 3, column 36" in problem.detail


def test_json_list_problems_are_the_same_across_chunk_boundaries(tmp_path):
    """Deep, broken, surrogate-holding and non-UTF-8 elements among good ones, read in chunks of every size."""
    elements = [
        '{"id": "g0", "t": "\\ud83d\\ude00"}',
        '{"deep": %s, "id": "deep"}' % ("[" * 3000 + "]" * 3000),
        '{"id": "g1"}',
        '{"id": "broken", "t": [1 2]}',
        '{"id": "sur", "t": ["x", "\\udc00"]}',
        '{"id": "latin", "t": "caf\udce9"}',
        '{"id": "g2", "t": "a\\\\ud800"}',
    ]
    path = tmp_path / "mixed.json"
    path.write_bytes(("[\n" + ",\n".join(elements) + "\n]").encode("utf-8", "surrogateescape"))
    expected = [(0, None, "g0"), (1, "too_deep", "deep"), (2, None, "g1"), (3, "invalid_json", "broken"),
                (4, "lone_surrogate", "sur"), (5, "non_utf8", "latin"), (6, None, "g2")]
    for chunk in (5, 64, 999, 1 << 20):
        got = list(iter_json_array(str(path), chunk_chars=chunk))
        seen = [(i, p.code if p else None, p.record_id if p else v["id"]) for i, v, p in got]
        assert seen == expected, chunk
        assert got[4][2].detail.startswith("t[1] holds \\udc00")
        assert [v for _, v, p in got if p is None] == [{"id": "g0", "t": "\U0001f600"}, {"id": "g1"},
                                                      {"id": "g2", "t": "a\\ud800"}]


def test_a_jsonl_line_over_the_limit_is_its_record_problem_and_the_next_lines_are_read(tmp_path):
    path = tmp_path / "d.jsonl"
    long_line = json.dumps({"id": "long", "t": "x" * 5000})
    exact = json.dumps({"id": "exact", "t": "y" * 20})
    path.write_text("\n".join([json.dumps({"id": 1}), long_line, "", exact, '{"id": 3}']) + "\n")
    got = list(iter_jsonl(str(path), max_record_bytes=len(exact)))  # a line of exactly the limit is read
    assert [(i, v) for i, v, _ in got] == [(0, {"id": 1}), (1, None), (3, {"id": "exact", "t": "y" * 20}),
                                           (4, {"id": 3})]
    problem = got[1][2]
    assert (problem.code, problem.record_id, problem.record_index) == ("record_too_large", "line 2", 1)
    assert problem.detail == f"record id 'long', {len(long_line) + 1} bytes, above data.validation.max_record_bytes={len(exact)}"
    assert problem.message(str(path)).startswith(f"{path}: record 'line 2' (#1): [record_too_large]")
    # the last line, without its newline, over the limit
    path.write_text(json.dumps({"id": 1}) + "\n" + long_line)
    assert [(i, p.code if p else v) for i, v, p in iter_records(str(path), 100)] == [(0, {"id": 1}),
                                                                                     (1, "record_too_large")]


_PEAK_RSS = """
import json, resource, sys
from mmtune.data.check import main
def check(path):
    return main(["check", path, "validation.max_record_bytes=" + sys.argv[4], "--allow-skips", "--cache-dir", sys.argv[3]])
check(sys.argv[1])  # warm up on a small file: imports and the first allocations of a check
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = check(sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"code": code, "growth_kib": after - before}))
"""


def test_a_huge_jsonl_line_is_skipped_in_bounded_memory_by_detection_and_loading(tmp_path):
    """A 300 MB line (a sparse file: nothing is written to disk) between two good records.

    ``mmtune data check FILE`` detects the format and reads every record in a child process,
    whose peak resident memory is measured before and after; reading the line whole would
    take at least its 300 MB."""
    limit = 16 << 20
    line_bytes = 300 << 20
    record = {"id": "r", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write((json.dumps({**record, "id": "before"}) + "\n").encode())
        f.write(b'{"id": "huge", "t": "')
        f.truncate(f.tell() + line_bytes)  # a hole of zero bytes, no newline
        f.seek(0, os.SEEK_END)
        f.write(('"}\n' + json.dumps({**record, "id": "after"}) + "\n").encode())
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps(record) + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(small), str(path), str(tmp_path / "cache"), str(limit)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0  # --allow-skips: the one skipped record is accepted
    assert "format llava (detected" in done.stdout and "kept 2, skipped 1" in done.stdout
    assert "record_too_large" in done.stdout and "line 2" in done.stdout
    # the peak grows by the part of the line held (up to the limit) and the check's own allocations
    # (about 5 MiB here), far below the 300 MB that reading the line whole takes
    print(f"peak RSS growth while checking a {line_bytes >> 20} MiB line: {result['growth_kib'] / 1024:.1f} MiB "
          f"(limit {limit >> 20} MiB)")
    assert result["growth_kib"] * 1024 < limit + (16 << 20), result

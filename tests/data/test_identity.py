"""A data file's identity: its content, not its name, size or time."""

import hashlib
import json
import os

from mmtune.data.config import SourceConfig
from mmtune.data.identity import (MISSING, comparable_record, content_keys, file_identity, source_identities,
                                  with_identities)


def test_the_identity_follows_the_content_whatever_the_size_and_time(tmp_path):
    path = tmp_path / "train.json"
    records = [{"id": f"r{i}", "text": "abc"[i]} for i in range(3)]
    path.write_text(json.dumps(records))
    before, stat = file_identity(path), path.stat()
    assert before == f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}, {stat.st_size} bytes"

    path.write_text(json.dumps(records[::-1]))  # another data set of the same size, at the same time
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and file_identity(path) != before

    path.write_text(json.dumps(records))
    os.utime(path, ns=(stat.st_atime_ns + 10**9, stat.st_mtime_ns + 10**9))  # touched or copied: same data
    assert file_identity(path) == before
    assert file_identity(tmp_path / "gone.json") == MISSING


def test_identities_take_one_key_per_source_in_the_config_record(tmp_path):
    (tmp_path / "a.json").write_text("[]")
    sources = [SourceConfig(name="a", format="llava", path=str(tmp_path / "a.json")),
               SourceConfig(name="b", format="llava", path=str(tmp_path / "b.json"))]
    record = {"data": {"mixture": {"sources": [{"name": "a"}, {"name": "b"}]}}, "training": {"lr": 1.0}}
    identities = source_identities(sources)
    recorded = with_identities(record, identities)
    assert [s["content"] for s in recorded["data"]["mixture"]["sources"]] == [file_identity(tmp_path / "a.json"),
                                                                              MISSING]
    assert "content" not in record["data"]["mixture"]["sources"][0]  # a copy
    assert content_keys(sources) == ["data.mixture.sources[0].content", "data.mixture.sources[1].content"]


def test_a_checkpoint_without_identities_is_compared_without_them_and_says_so():
    current = {"data": {"mixture": {"sources": [{"name": "a", "content": "sha256:1, 2 bytes"}]}}}
    old = {"data": {"mixture": {"sources": [{"name": "a"}]}}}
    compared, note = comparable_record(old, current)
    assert compared == old and "cannot be checked" in note
    assert comparable_record(current, current) == (current, None)

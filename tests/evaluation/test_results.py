import json
import math

import pytest

from mmtune.evaluation.results import BenchmarkResult, read_result, write_result


def test_round_trip_and_nan_written_as_null(tmp_path):
    result = BenchmarkResult("run", "model", "mmdu", {"Overall": 37.2, "valid/Overall": float("nan")}, {"turns": 3}, {"x": [1]}, 4096)
    path = write_result(result, tmp_path)
    assert path.name == "mmdu-ctx4096.json"
    raw = json.loads(path.read_text())
    assert raw["metrics"]["valid/Overall"] is None and list(raw) == ["run", "model", "benchmark", "context_length", "metrics", "counts", "meta"]
    back = read_result(path)
    assert back.metrics["Overall"] == 37.2 and math.isnan(back.metrics["valid/Overall"]) and back.context_length == 4096


def test_invalid_result_lists_all_problems(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"run": "r", "metrics": {"a": "high"}, "extra": 1}))
    with pytest.raises(ValueError) as err:
        read_result(path)
    message = str(err.value)
    assert "missing key 'model'" in message and "unknown key 'extra'" in message and "metric 'a' is str" in message

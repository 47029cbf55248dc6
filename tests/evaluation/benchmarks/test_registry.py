"""The benchmark registry: the built-in benchmarks found without a list, and registration mistakes named."""

from dataclasses import dataclass
from pathlib import Path

import pytest

import mmtune.evaluation.benchmarks as package
from mmtune.evaluation.benchmarks.base import Benchmark
from mmtune.evaluation.benchmarks.registry import benchmarks_for, get_benchmark, register, registered_names


def test_every_benchmark_module_of_the_package_is_registered_without_a_list():
    modules = {p.stem for p in Path(package.__path__[0]).glob("*.py")} - {"__init__", "base", "common", "registry"}
    assert modules == {"synthetic", "heldout", "mmdu", "mmvet", "mdi", "lmms_eval"}
    assert modules <= set(registered_names())
    for name in modules:
        bench = get_benchmark(name)
        assert bench.name == name and type(bench).__module__ == f"{package.__name__}.{name}"


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown benchmark 'mmbench'; choose from \[.*'mmdu'.*\]"):
        get_benchmark("mmbench")
    found = benchmarks_for(["mmdu", "ai2d", "mdi"])  # lmms-eval task names are not benchmarks
    assert set(found) == {"mmdu", "mdi"} and found["mmdu"].name == "mmdu"


@dataclass
class _Settings:
    data_path: str = ""


def test_registration_mistakes_are_named():
    class Nameless(Benchmark):
        settings_class = _Settings

    class Unsettled(Benchmark):
        name = "unsettled"

    class Impostor(Benchmark):
        name = "mmdu"
        settings_class = _Settings

    with pytest.raises(ValueError, match=r"Nameless: set the class attribute `name`"):
        register(Nameless)
    with pytest.raises(ValueError, match=r"Unsettled: set `settings_class`"):
        register(Unsettled)
    get_benchmark("mmdu")
    with pytest.raises(ValueError, match=r"benchmark 'mmdu' is registered twice .*MMDUBenchmark and .*Impostor"):
        register(Impostor)
    assert type(get_benchmark("mmdu")).__name__ == "MMDUBenchmark"

"""The benchmarks: one module each (synthetic, mmdu, mmvet, mdi, lmms_eval), the interface they
share (:mod:`.base`), the registry that finds them (:mod:`.registry`), MMDU-schema files
(:mod:`.common`) and their prompts (``prompts/``). A module added here is found without
being listed anywhere; see ``docs/evaluation.md``, "Adding a benchmark"."""

from mmtune.evaluation.benchmarks.base import Benchmark, BenchmarkWork, DialogueBenchmark, RunContext
from mmtune.evaluation.benchmarks.registry import benchmarks_for, get_benchmark, register, registered_names

__all__ = ["Benchmark", "DialogueBenchmark", "RunContext", "BenchmarkWork", "register", "get_benchmark",
           "registered_names", "benchmarks_for"]

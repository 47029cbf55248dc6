"""The MMDU paper's Tables 2, 3 and 5 as data, and how each cell maps onto mmtune results.

Numbers are copied from the paper (Liu et al., "MMDU: A Multi-Turn Multi-Image Dialog
Understanding Benchmark and Instruction-Tuning Dataset for LVLMs", arXiv:2406.11833,
Tables 2, 3 and 5). Each
table is a :class:`TableSpec`: rows name the runs (experiment names under
``configs/experiment/``) whose result JSONs fill them, columns name the benchmark and
metric that produce each value. :mod:`mmtune.evaluation.reporting.tables` renders a spec
against a directory of result files; nothing here reads files.

Run names: every experiment's ``run_name`` is its config file's name, and result files
carry it, so a row lists the evaluation experiments whose results may fill it
(``table5_baseline_2k`` runs ``recipes/evaluate.py +experiment=table5_baseline_2k``;
trained rows are filled by their ``*_eval`` experiment, which evaluates the training
run's ``final/``). Users whose runs are named differently remap rows with
``mmtune report --row TABLE.ROW=RUN``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = [
    "Column",
    "Row",
    "TableSpec",
    "TABLE2",
    "TABLE3",
    "TABLE5",
    "TINY_TABLE5",
    "TABLES",
    "MMDU_DIMENSIONS",
]

# MMDU metric names written by the evaluator (x10 scale, all turns) in the order of the
# paper's columns. Table 2's "Avg." is the judge's Overall Score, not the mean of the six.
MMDU_DIMENSIONS = ("C", "R", "VP", "LC", "AA", "IRU", "Overall")


@dataclass(frozen=True)
class Column:
    """One column of a paper table and where our value comes from.

    ``sources`` lists ``(benchmark, metric, scale)`` triples tried in order; the first
    metric found in a row's results fills the cell, multiplied by ``scale`` to the
    paper's unit. For lmms-eval tasks the evaluator's converter writes ``score`` already
    in percent (its headline metric); the raw lmms-eval metric, a fraction for most
    tasks, is the fallback.
    """

    key: str
    """Short id used in JSON output and plots."""
    label: str
    """Header as printed in the paper."""
    sources: tuple[tuple[str, str, float], ...] = ()
    """``(benchmark, metric, scale)`` triples in preference order."""
    mean_of: tuple[str, ...] = ()
    """If set, the cell is the mean of these other columns (Table 3 "Avg."): present
    only when every one of them is present, never averaged over a subset."""


@dataclass(frozen=True)
class Row:
    """One row of a paper table."""

    key: str
    """Short id (used by ``--row KEY=RUN`` remapping and in JSON output)."""
    label: str
    """Row label as printed in the paper."""
    runs: tuple[str, ...]
    """Run names whose results fill this row (experiment names by default)."""
    paper: tuple[Optional[float], ...]
    """The paper's values, one per column (``None`` where the paper has no number)."""
    context_length: Optional[int] = None
    """If set, only results evaluated at this context window fill the row."""


@dataclass(frozen=True)
class TableSpec:
    """A paper table: columns, rows and how to plot it."""

    key: str
    """``table2``, ``table3``, ``table5``, ``tiny_table5``."""
    title: str
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    plot: str = "bars"
    """``bars`` (grouped bars per column, paper vs ours) or ``context`` (score vs
    evaluation context length, one line per model, paper dashed and ours solid)."""
    plot_column: str = ""
    """Column shown by the ``context`` plot."""
    note: str = ""
    """Printed under the table: provenance and caveats."""
    series: dict[str, str] = field(default_factory=dict)
    """``context`` plot only: row key -> model series name (rows of the same series
    at different context lengths form one line)."""


def _mmdu(metric: str) -> tuple[tuple[str, str, float], ...]:
    return (("mmdu", metric, 1.0),)


_MMDU_COLUMNS = tuple(
    Column(key=m, label="Avg." if m == "Overall" else m, sources=_mmdu(m)) for m in MMDU_DIMENSIONS
)

TABLE2 = TableSpec(
    key="table2",
    title="Table 2: MMDU (C / R / VP / LC / AA / IRU / Avg.)",
    columns=_MMDU_COLUMNS,
    rows=(
        # GPT-4o is an API model: score its answers with `mmtune evaluate` on a predictions
        # file and name that run `gpt4o` to fill this row.
        Row("gpt4o", "GPT-4o", ("gpt4o",), (63.7, 69.6, 66.7, 80.6, 73.3, 68.1, 70.2)),
        Row("llava15_7b", "LLaVA1.5-7B", ("table3_llava15_7b",), (27.8, 28.0, 33.2, 43.0, 35.4, 31.7, 32.2)),
        Row(
            "llava15_7b_mmdu45k",
            "LLaVA1.5-7B + MMDU-45k",
            ("table3_llava15_7b_mmdu45k_eval",),
            (34.3, 34.5, 36.7, 47.2, 38.5, 35.5, 37.2),
        ),
        Row("xc2", "InternLM-XC2", ("table3_xc2",), (29.7, 29.5, 36.2, 50.1, 40.3, 35.2, 35.6)),
        Row("xc2_mmdu45k", "InternLM-XC2 + MMDU-45k", ("table3_xc2_mmdu45k_eval",), (45.6, 43.9, 49.9, 64.1, 53.0, 48.7, 50.1)),
    ),
    note="MMDU scores x10 over all judged turns (unparsed judge replies count as 0); "
    "Avg. is the judge's Overall Score, as in the paper.",
)


def _lmms(label: str, key: str, task: str, raw_metric: str, raw_scale: float) -> Column:
    return Column(key, label, ((task, "score", 1.0), (task, raw_metric, raw_scale)))


# lmms-eval task names and their headline metrics (raw metric, factor to percent).
_T3_COLUMNS = (
    Column("mmdu", "MMDU", _mmdu("Overall")),
    _lmms("MMB-Dev-EN", "mmbench", "mmbench_en_dev", "gpt_eval_score", 1.0),
    _lmms("MMMU-Val", "mmmu", "mmmu_val", "mmmu_acc", 100.0),
    _lmms("MMStar", "mmstar", "mmstar", "average", 100.0),
    _lmms("MathVista", "mathvista", "mathvista_testmini", "gpt_eval_score", 1.0),
    _lmms("AI2D", "ai2d", "ai2d", "exact_match", 100.0),
    _lmms("HallBench", "hallbench", "hallusion_bench_image", "aAcc", 1.0),
    Column("mmvet", "MMVet", (("mmvet", "total", 1.0),)),
    _lmms("ChartQA", "chartqa", "chartqa", "relaxed_overall", 100.0),
)
TABLE3 = TableSpec(
    key="table3",
    title="Table 3: MMDU and existing benchmarks",
    columns=_T3_COLUMNS + (Column("avg", "Avg.", mean_of=tuple(c.key for c in _T3_COLUMNS)),),
    rows=(
        Row("llava15_7b", "LLaVA1.5", ("table3_llava15_7b",), (32.2, 66.5, 35.7, 33.1, 25.2, 55.5, 48.8, 31.6, 21.2, 38.9)),
        Row(
            "llava15_7b_mmdu45k",
            "LLaVA1.5 + MMDU-45k",
            ("table3_llava15_7b_mmdu45k_eval",),
            (37.2, 66.5, 37.4, 34.1, 25.2, 56.2, 48.7, 31.9, 23.4, 40.1),
        ),
        Row("xc2", "InternLM-XC2", ("table3_xc2",), (35.6, 79.5, 41.4, 56.2, 57.2, 81.2, 60.0, 37.6, 62.6, 56.8)),
        Row(
            "xc2_mmdu45k",
            "InternLM-XC2 + MMDU-45k",
            ("table3_xc2_mmdu45k_eval",),
            (50.1, 79.9, 41.9, 57.3, 58.7, 81.2, 60.4, 38.8, 63.8, 59.1),
        ),
    ),
    note="MMDU: Overall x10. MMVet: mean of the judge-run totals. Other columns come from "
    "lmms-eval (converted by mmtune's evaluator), in percent. "
    "Avg. is the mean of the nine columns and is only shown when all nine are present.",
)

TABLE5 = TableSpec(
    key="table5",
    title="Table 5: context length and SFT strategy (LLaVA-1.5-7B, MMDU)",
    columns=_MMDU_COLUMNS[:-1] + (Column("Overall", "Overall", _mmdu("Overall")),),
    rows=(
        Row("baseline_2k", "LLaVA1.5 @2k", ("table5_baseline_2k",), (19.0, 19.0, 21.8, 29.3, 22.5, 19.6, 20.9), 2048),
        Row("baseline_4k", "LLaVA1.5 @4k", ("table5_baseline_4k",), (25.4, 25.6, 31.1, 40.8, 32.9, 29.5, 30.0), 4096),
        Row("mmdu45k_2k", "+MMDU-45k @2k", ("table5_mmdu45k_eval_2k",), (20.0, 20.1, 22.1, 29.4, 23.5, 21.6, 22.3), 2048),
        Row("mmdu45k_4k", "+MMDU-45k @4k", ("table5_mmdu45k_eval_4k",), (31.5, 32.3, 34.9, 45.0, 36.3, 33.8, 34.9), 4096),
        Row("mmdu45k_8k", "+MMDU-45k @8k", ("table5_mmdu45k_eval_8k",), (34.2, 34.3, 36.1, 48.2, 39.6, 34.7, 37.1), 8192),
        Row("sft_continue", "Continue training", ("table5_sft_continue_eval", "table3_llava15_7b_mmdu45k_eval"), (34.3, 34.5, 36.7, 47.2, 38.5, 35.5, 37.2)),
        Row("sft_pool", "Add to the existing pool", ("table5_sft_pool_eval",), (34.3, 36.3, 37.1, 47.3, 38.9, 35.7, 37.3)),
    ),
    plot="context",
    plot_column="Overall",
    series={
        "baseline_2k": "LLaVA1.5",
        "baseline_4k": "LLaVA1.5",
        "mmdu45k_2k": "+MMDU-45k (trained at 8k)",
        "mmdu45k_4k": "+MMDU-45k (trained at 8k)",
        "mmdu45k_8k": "+MMDU-45k (trained at 8k)",
    },
    note="Rows with a window are evaluated with that context window; the +MMDU-45k model "
    "is trained once at 8k with linear RoPE interpolation. The row-to-setting mapping comes "
    "from an OCR'd copy of the paper; the two strategy readings are an interpretation of the "
    "public scripts.",
)

# The CPU-sized analogue of Table 5 (configs/experiment/tiny_table5_*.yaml,
# docs/reproduction.md): a tiny LLaVA whose original window is W, then continued at 2W with
# linear RoPE interpolation, both scored by exact match on the synthetic held-out split
# at W and 2W. There is no paper number.
TINY_WINDOW = 256
TINY_TABLE5 = TableSpec(
    key="tiny_table5",
    title="Tiny Table 5 analogue: synthetic exact match vs evaluation window (tiny LLaVA, CPU)",
    columns=(Column("exact_match", "Exact match", (("synthetic", "exact_match", 1.0),)),),
    rows=(
        Row("baseline_1x", f"baseline @{TINY_WINDOW}", ("tiny_table5_baseline_eval_1x",), (None,), TINY_WINDOW),
        Row("baseline_2x", f"baseline @{2 * TINY_WINDOW}", ("tiny_table5_baseline_eval_2x",), (None,), 2 * TINY_WINDOW),
        Row("long_1x", f"+long SFT @{TINY_WINDOW}", ("tiny_table5_long_eval_1x",), (None,), TINY_WINDOW),
        Row("long_2x", f"+long SFT @{2 * TINY_WINDOW}", ("tiny_table5_long_eval_2x",), (None,), 2 * TINY_WINDOW),
    ),
    plot="context",
    plot_column="exact_match",
    series={
        "baseline_1x": "baseline",
        "baseline_2x": "baseline",
        "long_1x": "+long SFT (RoPE x2)",
        "long_2x": "+long SFT (RoPE x2)",
    },
    note="No paper numbers: this table checks the pipeline end to end on CPU.",
)

TABLES: dict[str, TableSpec] = {t.key: t for t in (TABLE2, TABLE3, TABLE5, TINY_TABLE5)}


def _check(spec: TableSpec) -> None:
    # Import-time sanity: a typo in a row's number list would silently shift cells.
    for row in spec.rows:
        if len(row.paper) != len(spec.columns):
            raise ValueError(
                f"{spec.key} row {row.key!r} has {len(row.paper)} paper values for {len(spec.columns)} columns"
            )
    for key in spec.series:
        if key not in {r.key for r in spec.rows}:
            raise ValueError(f"{spec.key}: plot series names unknown row {key!r}")


for _spec in TABLES.values():
    _check(_spec)

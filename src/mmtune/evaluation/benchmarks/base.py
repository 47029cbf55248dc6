"""The one interface every benchmark implements.

A benchmark is a :class:`Benchmark` subclass in its own module of this package,
registered by name with :func:`~mmtune.evaluation.benchmarks.registry.register`; its
settings are the ``eval.<name>`` section of the config, typed by its ``settings_class``
(a dataclass in the same module). The runner calls the same steps for each, with no
per-benchmark code:

1. :meth:`Benchmark.check` at start-up (before any model is loaded or judge paid);
2. :meth:`Benchmark.load` the items (questions and references);
3. either :meth:`Benchmark.load_predictions` from the configured ``predictions`` file, or
   :meth:`Benchmark.dialogues` -> the shared generator -> :meth:`Benchmark.from_generations`;
4. :meth:`Benchmark.score` -> one result plus per-item detail rows;
5. :meth:`Benchmark.write_files` for benchmark-specific official outputs;
6. :meth:`Benchmark.report_section` for its part of ``report.md``.

Around a run a benchmark also answers for itself: :meth:`Benchmark.viewer_entries` (its
tab in ``viewer.html``), :meth:`Benchmark.count_work` (what ``mmtune plan`` prints: items,
answers, judge calls, images) and :meth:`Benchmark.cli_defaults` (the decoding defaults
of ``mmtune evaluate``, from its ``configs/eval/<name>.yaml``).

A benchmark that runs elsewhere (lmms-eval) overrides :meth:`Benchmark.evaluate` whole.
Adding a benchmark: one module with a settings dataclass and a registered subclass, and
its ``configs/eval/<name>.yaml``; nothing else names it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence

from mmtune.evaluation.results import BenchmarkResult
from mmtune.io.nofollow import open_output

__all__ = ["Benchmark", "DialogueBenchmark", "RunContext", "BenchmarkWork", "count_image_items"]


@dataclass
class BenchmarkWork:
    """What evaluating one benchmark takes, counted from its data without a model (``mmtune plan``)."""

    name: str
    data_path: Optional[str]
    items: int
    """Dialogues or questions; 0 when nothing is read (a predictions file, lmms-eval)."""
    answers: int
    """Answers the model generates."""
    judge_calls: int
    """Judge calls (before the cache: a re-run pays nothing again)."""
    images: int
    note: str = ""
    """What the counts leave out, when they are zero."""


def _row(row: Any) -> Any:
    return dataclasses.asdict(row) if dataclasses.is_dataclass(row) else row


class RunContext:
    """What a benchmark may use during a run: config, output folder, the shared
    generator and judge (both built on first use), labels."""

    def __init__(self, cfg: Any, out: Path, make_generator: Optional[Callable[[], Any]], *, run: str, model: str,
                 checkpoint: Optional[str] = None, family: Optional[str] = None, model_config: Any = None,
                 lmms_pretrained: Optional[str] = None, lmms_is_adapter: bool = False,
                 command_runner: Optional[Callable[..., Any]] = None, layout: Any = None):
        import subprocess

        from mmtune.evaluation.generation.data_parallel import Layout

        self.cfg, self.out, self._make_generator = cfg, out, make_generator
        self.layout = layout or Layout()
        """This process's place in a data-parallel evaluation (one process by default)."""
        self.generated: dict[str, list[Any]] = {}
        """Turn records per benchmark, once generated (all ranks' in a data-parallel run)."""
        self.rank_work: dict[str, list[dict[str, Any]]] = {}
        """Per benchmark, what each rank of a data-parallel run did."""
        self.generation_usage: dict[str, dict[str, Any]] = {}
        """Per benchmark, what a served model's calls cost (``api`` backend)."""
        self.run, self.model, self.checkpoint, self.family = run, model, checkpoint, family
        self.model_config = model_config
        """The ModelConfig the model is loaded with (lmms-eval's mmtune model loads it the same way)."""
        self.lmms_pretrained = lmms_pretrained
        """What lmms-eval loads: the exported checkpoint, or ``model.path`` for a base model."""
        self.lmms_is_adapter = lmms_is_adapter
        self.command_runner = command_runner or subprocess.run
        """Runs external commands (lmms-eval); a dry run replaces it to record them."""
        self.context_length = cfg.generation.context_length
        self.image_limits = getattr(model_config, "image_limits", None)
        """The largest images decoded or sent (``model.image_limits``; ``None``: the defaults)."""
        self._generator = None
        self._judge = None

    @property
    def generator(self):
        if self._generator is None:
            if self._make_generator is None:
                raise ValueError(
                    "a benchmark needs generation but no model was given: set `checkpoint` / `model.path`, or set "
                    "the benchmark's `predictions` file to score existing answers"
                )
            self._generator = self._make_generator()
        return self._generator

    @property
    def judge(self):
        if self._judge is None:
            from mmtune.evaluation.judge.client import JudgeClient

            judge_cfg = self.cfg.judge
            cache = judge_cfg.cache_path or str(self.out / "judge_cache.sqlite")
            self._judge = JudgeClient(judge_cfg, cache_path=cache, image_limits=self.image_limits)
            print(self._judge.describe(), file=sys.stderr, flush=True)
        return self._judge

    @property
    def has_judge(self) -> bool:
        return self._judge is not None

    @property
    def has_generator(self) -> bool:
        return self._generator is not None

    def generate(self, name: str, dialogues: Sequence[Any]):
        """The turn records of ``dialogues`` for benchmark ``name``, generated once per run (by
        every rank of a data-parallel run, each its share) into ``generations/<name>.jsonl``."""
        from mmtune.evaluation.generation.data_parallel import generate_shared

        if name not in self.generated:
            records, ranks = generate_shared(self.generator, dialogues, self.out / "generations" / f"{name}.jsonl",
                                             layout=self.layout, progress=self.cfg.progress, run_key=self.run_key(name))
            self.generated[name] = records
            if ranks is not None:
                self.rank_work[name] = ranks
            usage = self.generator.usage()
            if usage is not None:
                self.generation_usage[name] = usage
        return self.generated[name]

    def check_generation(self, name: str) -> None:
        """Raise :class:`~mmtune.evaluation.generation.records.GenerationFailures` when more
        than ``eval.generation.api.max_failed_share`` of benchmark ``name``'s turns failed."""
        from mmtune.evaluation.generation.records import check_failed_turns

        if self.generated.get(name):
            check_failed_turns(self.generated[name], self.cfg.generation.api.max_failed_share, benchmark=name)

    def run_key(self, name: str) -> dict[str, Any]:
        """What a benchmark's answers depend on besides decoding: the model and the data file
        (a resumed generations file made for other weights or data is refused)."""
        import time

        from mmtune.evaluation.generation.fingerprint import file_identity

        sub = getattr(self.cfg, name)
        checkpoint = self.model
        if Path(checkpoint).is_dir():  # the run dir and its final/ name the same weights
            directory = Path(checkpoint).resolve()
            if (directory / "final").is_dir() and not (directory / "config.json").exists():
                directory = directory / "final"
            checkpoint = str(directory)
        return {
            "checkpoint": checkpoint,
            "data": file_identity(sub.data_path),
            "image_root": sub.image_root,
            "about": {"run": self.run, "model": self.model, "started": time.strftime("%Y-%m-%d %H:%M:%S")},
        }

    def write_details(self, name: str, rows: Sequence[Any]) -> Path:
        path = self.out / "details" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_output(path, "w") as handle:
            for row in rows:
                handle.write(json.dumps(_row(row), ensure_ascii=False, default=str) + "\n")
        return path

    def close(self) -> None:
        if self._judge is not None:
            self._judge.close()
        close = getattr(self._generator, "close", None)  # a served model's HTTP client
        if close is not None:
            close()


class Benchmark:
    """Base of every benchmark; see the module docstring for the steps."""

    name: ClassVar[str] = ""
    settings_class: ClassVar[Optional[type]] = None
    """The dataclass of the ``eval.<name>`` section (every field with a docstring)."""
    uses_judge: ClassVar[bool] = False
    """Whether scoring calls the LLM judge (its failures then fail the run)."""
    generates: ClassVar[bool] = True
    """Whether answers come from mmtune's generator (else the benchmark runs its own model)."""

    config_root: ClassVar[Optional[str]] = None
    """The configs folder holding this benchmark's ``eval/<name>.yaml``; ``None``: the
    project's ``configs/`` (a benchmark kept elsewhere names its own folder)."""
    viewer_scale: ClassVar[str] = ""
    """How to read an entry's score in ``viewer.html`` (``% correct``, ``x100``)."""

    def settings(self, cfg: Any) -> Any:
        return getattr(cfg, self.name)

    def config_file(self) -> Path:
        """This benchmark's ``eval/<name>.yaml``: the settings it is meant to be run with."""
        from mmtune.data.config import configs_dir

        return Path(self.config_root or configs_dir()) / "eval" / f"{self.name}.yaml"

    def cli_defaults(self) -> dict[str, Any]:
        """``{"generation.max_new_tokens": 512, ...}``: the decoding settings (``generation``
        section) of :meth:`config_file`, which ``mmtune evaluate checkpoint`` starts from, so
        the command decodes as the benchmark's config does. Data paths and the judge come
        from the command's flags and the environment instead. ``{}`` without a file.

        Raises:
            ValueError: the file's ``generation`` section is not a mapping.
        """
        from omegaconf import OmegaConf

        path = self.config_file()
        if not path.is_file():
            return {}
        generation = (OmegaConf.to_container(OmegaConf.load(path)) or {}).get("generation") or {}
        if not isinstance(generation, dict):
            raise ValueError(f"{path}: `generation` must be a mapping of eval.generation settings")
        return {f"generation.{key}": value for key, value in generation.items()}

    def preflight(self, ctx: RunContext) -> list[str]:
        """Problems that need the run's context (model family, checkpoint), found before anything runs."""
        return []

    def check(self, cfg: Any) -> list[str]:
        """Problems of this benchmark's settings, found before anything runs."""
        sub = self.settings(cfg)
        if not getattr(sub, "data_path", None) and not getattr(sub, "predictions", None):
            return [f"eval.{self.name}: set data_path (to generate) or predictions (to score a file)"]
        return []

    def load(self, sub: Any, ctx: RunContext) -> list[Any]:
        raise NotImplementedError

    def image_checks(self, sub: Any, ctx: RunContext) -> str:
        """How :meth:`load` checks the items' image files: ``verify`` (each exists, opens as an
        image and is within ``model.image_limits``, all found before anything runs) when the
        images will be decoded (generation) or sent to the judge; ``none`` when only a
        predictions file is scored."""
        generates = self.generates and not getattr(sub, "predictions", None)
        sends = self.uses_judge and bool(ctx.cfg.judge.send_images)
        return "verify" if generates or sends else "none"

    def pending_dialogues(self, ctx: RunContext) -> list[Any]:
        """The dialogues :meth:`evaluate` hands the generator (``[]`` when it scores a
        predictions file or runs its own model): what a data-parallel run splits across
        its ranks before rank 0 scores."""
        sub = self.settings(ctx.cfg)
        if not self.generates or getattr(sub, "predictions", None):
            return []
        return list(self.dialogues(self.load(sub, ctx), sub))

    def dialogues(self, items: list[Any], sub: Any) -> list[Any]:
        """The items as dialogues for the generator."""
        raise NotImplementedError

    def load_predictions(self, path: str, items: list[Any], sub: Any) -> Any:
        raise NotImplementedError

    def from_generations(self, records: list[Any], items: list[Any]) -> Any:
        """Predictions from the generator's turn records."""
        raise NotImplementedError

    def score(self, items: list[Any], predictions: Any, ctx: RunContext, sub: Any) -> tuple[BenchmarkResult, list[Any]]:
        raise NotImplementedError

    def write_files(self, result: BenchmarkResult, rows: list[Any], items: list[Any], predictions: Any,
                    ctx: RunContext, sub: Any) -> None:
        """Benchmark-specific outputs beside the result JSON (official formats)."""

    def evaluate(self, ctx: RunContext) -> list[BenchmarkResult]:
        sub = self.settings(ctx.cfg)
        items = self.load(sub, ctx)
        if getattr(sub, "predictions", None):
            predictions = self.load_predictions(sub.predictions, items, sub)
        else:
            predictions = self.from_generations(list(ctx.generate(self.name, self.dialogues(items, sub))), items)
        result, rows = self.score(items, predictions, ctx, sub)
        ctx.write_details(result.benchmark, rows)
        self.write_files(result, rows, items, predictions, ctx, sub)
        return [result]

    def report_section(self, result: BenchmarkResult, out: Path) -> tuple[list[str], list[Path]]:
        """Markdown lines (and plots) for the report; default: every metric in one table."""
        from mmtune.evaluation.reporting.report import metrics_section

        return metrics_section(result), []

    def count_work(self, sub: Any, cache_dir: Optional[str]) -> tuple[BenchmarkWork, list[str]]:
        """What evaluating ``sub`` takes, and every problem that would stop it (missing
        files or images), found without loading a model. A ``predictions`` file is only
        checked to exist; otherwise :meth:`count_items` reads ``data_path``."""
        problems: list[str] = []
        if getattr(sub, "predictions", None):
            if not os.path.isfile(sub.predictions):
                problems.append(f"eval.{self.name}.predictions={sub.predictions!r} does not exist")
            return BenchmarkWork(self.name, sub.predictions, 0, 0, 0, 0, note="scores an existing predictions file"), problems
        path = getattr(sub, "data_path", None)
        if not path or not os.path.isfile(path):
            problems.append(f"eval.{self.name}.data_path={path!r} does not exist (download the benchmark or set the path)")
            return BenchmarkWork(self.name, path, 0, 0, 0, 0), problems
        return self.count_items(sub, cache_dir, problems), problems

    def count_items(self, sub: Any, cache_dir: Optional[str], problems: list[str]) -> BenchmarkWork:
        """Count the existing ``sub.data_path`` (appending problems). Default: its records (a
        JSON list or dict, or JSON lines) as single-turn items, one answer each, judged
        when :attr:`uses_judge`; images are not counted."""
        from mmtune.evaluation.benchmarks.common import load_json_or_jsonl

        n = len(load_json_or_jsonl(sub.data_path))
        return BenchmarkWork(self.name, sub.data_path, n, n, n if self.uses_judge else 0, 0)

    def viewer_entries(self, sub: Any, out: Path, *, allow_absolute_image_paths: bool = False) -> Optional[list[Any]]:
        """The rows of this benchmark's tab in ``viewer.html``
        (:class:`~mmtune.evaluation.reporting.viewer.ViewerEntry`), from its data file and
        the evaluation's files under ``out`` (``details/<name>.jsonl``, generations); image
        paths resolve as when the items were loaded (``eval.allow_absolute_image_paths``).
        ``None`` (the default): the benchmark has no tab."""
        return None


class DialogueBenchmark(Benchmark):
    """Items are MMDU-schema dialogues; predictions are answers keyed by (dialogue, exchange)."""

    def load(self, sub: Any, ctx: RunContext) -> list[Any]:
        if not sub.data_path:
            raise ValueError(f"eval.{self.name}.data_path is required: it holds the questions and reference answers")
        return self.read_dialogues(sub, allow_absolute_image_paths=ctx.cfg.allow_absolute_image_paths,
                                   check_images=self.image_checks(sub, ctx), image_limits=ctx.image_limits)

    def read_dialogues(self, sub: Any, *, allow_absolute_image_paths: bool = False, check_images: str = "none",
                       image_limits: Any = None) -> list[Any]:
        """The dialogues of ``sub.data_path`` (MMDU schema), its first ``sub.limit``; what
        :meth:`load` and :meth:`viewer_entries` read. A benchmark on other files overrides it.
        ``check_images``: see :meth:`image_checks`; ``image_limits``: ``model.image_limits``."""
        from mmtune.evaluation.benchmarks.common import load_mmdu_dialogues

        return load_mmdu_dialogues(sub.data_path, image_root=sub.image_root, source=self.name, limit=sub.limit,
                                   allow_absolute_image_paths=allow_absolute_image_paths, check_images=check_images,
                                   image_limits=image_limits)

    def check(self, cfg: Any) -> list[str]:
        if not self.settings(cfg).data_path:
            return [f"eval.{self.name}.data_path is required: it holds the questions and reference answers"]
        return []

    def dialogues(self, items: list[Any], sub: Any) -> list[Any]:
        return items

    def load_predictions(self, path: str, items: list[Any], sub: Any) -> Any:
        from mmtune.evaluation.benchmarks.common import load_turn_predictions

        return load_turn_predictions(path)

    def from_generations(self, records: list[Any], items: list[Any]) -> Any:
        from mmtune.evaluation.benchmarks.common import TurnPrediction

        return {(r.dialogue_id, r.turn): TurnPrediction(r.answer, {"finish_reason": r.finish_reason, "context": r.context})
                for r in records if r.answer is not None}

    def source_config(self, sub: Any) -> Any:
        """``sub.data_path`` as a data-layer source (MMDU schema), for :meth:`count_items`."""
        from mmtune.data.config import SourceConfig

        return SourceConfig(name=f"eval_{self.name}", format="mmdu", path=sub.data_path, image_root=sub.image_root)

    def count_items(self, sub: Any, cache_dir: Optional[str], problems: list[str]) -> BenchmarkWork:
        """Dialogues read through the data layer (MMDU schema, images checked to exist), one
        answer per question/answer exchange, one judge call each when :attr:`uses_judge`."""
        from mmtune.data.readers import load_source

        loaded = load_source(self.source_config(sub), mode="skip", cache_dir=cache_dir, check_images="exists")
        if loaded.report.records_skipped:
            problems.append(f"eval.{self.name}: {loaded.report.records_skipped} dialogue(s) cannot be evaluated\n"
                            + loaded.report.render())
        answers = sum(sum(1 for _ in d.exchanges()) for d in loaded.dialogues)
        return BenchmarkWork(self.name, sub.data_path, len(loaded), answers, answers if self.uses_judge else 0,
                             loaded.report.images)

    def viewer_entries(self, sub: Any, out: Path, *, allow_absolute_image_paths: bool = False) -> Optional[list[Any]]:
        """One entry per dialogue, one turn per question/answer exchange (``details`` rows
        number them from 1, the generator's records by position from 0); each turn's scores
        and status come from :meth:`viewer_turn`, the entry's score from :meth:`viewer_score`."""
        from mmtune.evaluation.reporting.viewer import ViewerEntry, read_jsonl

        dialogues = self.read_dialogues(sub, allow_absolute_image_paths=allow_absolute_image_paths)
        details = {(r["dialogue_id"], int(r["turn"])): r for r in read_jsonl(out / "details" / f"{self.name}.jsonl")}
        generated = {(r["dialogue_id"], int(r["turn"])): r.get("answer")
                     for r in read_jsonl(out / "generations" / f"{self.name}.jsonl")}
        entries = []
        for dialogue in dialogues:
            turns, rows = [], []
            shown = 0
            for t, (u, a) in enumerate(dialogue.exchanges()):
                row = details.get((dialogue.id, t + 1), {})  # detail rows number turns from 1
                question = []
                for segment in dialogue.turns[u].segments:
                    if isinstance(segment, str):
                        question.append(segment)
                    else:
                        shown += 1  # numbered as the thumbnails are: the k-th image of the dialogue
                        question.append(f"[image #{shown}]")
                turn = {"question": "".join(question).strip(), "images": [i.path for i in dialogue.turns[u].images],
                        "answer": row.get("answer", generated.get((dialogue.id, t))),
                        "reference": dialogue.turns[a].text, "scores": {}, "status": row.get("status", ""),
                        "rationale": row.get("reply") or ""}
                self.viewer_turn(turn, row)
                turns.append(turn)
                rows.append(row)
            score, facets = self.viewer_score(turns, rows)
            facets["images"] = dialogue.num_images
            entries.append(ViewerEntry(dialogue.id, score, turns, facets))
        return entries

    def viewer_turn(self, turn: dict[str, Any], row: dict[str, Any]) -> None:
        """Fill ``turn``'s ``scores`` / ``status`` / ``rationale`` from its detail ``row`` (in place)."""

    def viewer_score(self, turns: list[dict[str, Any]], rows: list[dict[str, Any]]) -> tuple[Optional[float], dict[str, Any]]:
        """The dialogue's score and facets from its turns and detail rows."""
        return None, {}


def count_image_items(bench: Benchmark, sub: Any, problems: list[str], image_of: Callable[[dict], str],
                      judge_calls_per_item: int) -> BenchmarkWork:
    """:meth:`Benchmark.count_items` of a benchmark whose records (a JSON list or dict) are
    single-turn questions about one image each, ``image_of(record)`` naming its file under
    ``sub.image_root``; missing image files are reported as one problem."""
    from mmtune.evaluation.benchmarks.common import load_json_or_jsonl

    data = load_json_or_jsonl(sub.data_path)
    items = list(data.values()) if isinstance(data, dict) else list(data)
    missing = 0
    if sub.image_root:
        missing = sum(not os.path.isfile(os.path.join(sub.image_root, image_of(item))) for item in items)
    if missing:
        problems.append(f"eval.{bench.name}: {missing} of {len(items)} images are missing under {sub.image_root}")
    return BenchmarkWork(bench.name, sub.data_path, len(items), len(items), len(items) * judge_calls_per_item, len(items))

"""Readers: a data file of any registered format into :class:`~mmtune.core.dialogue.Dialogue`
objects, validated and cached.

A source's records come from :func:`mmtune.data.records.iter_records` (a JSON list read
as a stream, or JSONL), are converted by the source's format (:mod:`mmtune.data.formats`:
one module per format), checked (:mod:`mmtune.data.validation`), and every kept record
goes straight to the Arrow cache (:mod:`mmtune.data.cache`). The returned
:class:`SourceData` reads dialogues back lazily from the memory-mapped cache.

Image paths are resolved per source by :class:`mmtune.data.paths.ImagePathRules` (the
same rule evaluation uses): ``strip_image_prefix`` is removed, then relative paths and
the datasets' rooted paths (the benchmark's ``/mmdu_pics/x.jpg``) are joined under
``image_root`` (default: the data file's folder) and must stay inside it; a plain
absolute path outside it (any absolute path or ``file://`` URL in a format whose paths
are real ones, such as ``messages``) is used only with
``data.allow_absolute_image_paths=true``. A rejected path is a ``path_outside_root``
problem; a missing image's report shows the path tried and how it was built.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Iterator

import numpy as np

from mmtune.core.dialogue import Dialogue
from mmtune.core.images import ImageLimits
from mmtune.data.cache import CacheWriter, DialogueSequence, cache_key, entry_paths, open_entry
from mmtune.data.config import IMAGE_CHECKS, MODES, DataConfig, SourceConfig, default_cache_dir
from mmtune.data.formats import ConvertContext, get_format
from mmtune.data.formats.conversations import LLAVA_PLACEHOLDER, MMDU_PLACEHOLDER
from mmtune.data.formats.base import ROLE_MAP
from mmtune.data.keys import RecordKeys
from mmtune.data import parallel_read
from mmtune.data.paths import ImagePathRules
from mmtune.data.records import MAX_RECORD_BYTES, iter_json_array, iter_jsonl, iter_records, surrogate_problem
from mmtune.data.tables import EmbeddedImages, default_image_root, input_files, is_table_input, iter_table_records
from mmtune.data.validation import (DataValidationError, ImageChecker, Problem, TextLimits, ValidationReport,
                                    check_dialogue)


def _context(fmt: str, source: str, rules: ImagePathRules, move_image_to_start: bool | None) -> ConvertContext:
    """The conversion context of a source; ``move_image_to_start=None``: the format's default."""
    default = get_format(fmt).image_to_start
    return ConvertContext(source, rules, bool(default) if move_image_to_start is None else bool(move_image_to_start))


def convert_record(fmt: str, obj: Any, index: int, ctx: ConvertContext) -> tuple[Dialogue | None, list[Problem]]:
    """Record number ``index`` of format ``fmt`` -> its dialogue, or ``None`` and the problems preventing it."""
    return get_format(fmt).convert(obj, index, ctx)


def parse_record(
    fmt: str,
    record: Any,
    *,
    source: str = "record",
    image_root: str | None = None,
    move_image_to_start: bool | None = None,
) -> Dialogue:
    """One record of format ``fmt`` -> :class:`Dialogue`, with the same conversion (and
    defaults) as a data source; image paths are joined under ``image_root`` (default: the
    working directory) and not checked. Raises ``ValueError`` naming the problem."""
    rules = ImagePathRules(root=image_root or os.getcwd(), join_rooted=get_format(fmt).joins_rooted_paths)
    dialogue, problems = convert_record(fmt, record, 0, _context(fmt, source, rules, move_image_to_start))
    if dialogue is None:
        raise ValueError(f"{fmt} record {source!r}: " + "; ".join(f"{p.code}: {p.detail}" for p in problems))
    return dialogue


@dataclass
class SourceData:
    """One loaded source: its dialogues (Arrow-backed), validation report and statistics."""

    name: str
    config: SourceConfig
    dialogues: DialogueSequence
    report: ValidationReport
    cache_file: str

    def __len__(self) -> int:
        return len(self.dialogues)

    @property
    def num_images(self) -> np.ndarray:
        """Images per record (int array), read from the cache without decoding records."""
        return self.dialogues.dataset.data.column("num_images").to_numpy()

    @property
    def num_chars(self) -> np.ndarray:
        """Text characters per record (int array)."""
        return self.dialogues.dataset.data.column("num_chars").to_numpy()

    def estimated_tokens(self, tokens_per_image: int) -> np.ndarray:
        """Cheap token estimate per record: characters / 4 + ``tokens_per_image`` per image."""
        return self.num_chars // 4 + self.num_images.astype(np.int64) * tokens_per_image


def embedded_images_dir(cache_dir: str | None) -> str:
    """Where the embedded images of tabular inputs are stored, by content (:mod:`mmtune.data.tables`)."""
    return os.path.join(cache_dir or default_cache_dir(), "images")


def image_rules(source_cfg: SourceConfig, allow_absolute: bool = False, cache_dir: str | None = None) -> ImagePathRules:
    """The image path rule of one source: its ``image_root`` (default: the data file's folder,
    or the folder of shards), and the stored embedded images of a tabular input."""
    tabular = is_table_input(source_cfg.path)
    return ImagePathRules(
        root=os.path.abspath(source_cfg.image_root or default_image_root(source_cfg.path)),
        extra_roots=(embedded_images_dir(cache_dir),) if tabular else (),
        allow_absolute=allow_absolute,
        strip_prefix=source_cfg.strip_image_prefix,
        # User-made chat files carry real absolute paths; the datasets' absolute paths
        # (the benchmark's /mmdu_pics/...) are relative to where the pictures were unpacked.
        join_rooted=get_format(source_cfg.format).joins_rooted_paths,
    )


def _entry_options(source_cfg: SourceConfig, image_root: str | None, allow_absolute_image_paths: bool,
                   check_images: str, max_examples: int, limits: ImageLimits, max_record_bytes: int,
                   unique_ids: bool, drop_exact_duplicates: bool, text_limits: TextLimits) -> dict[str, Any]:
    """Every reader option that decides a cache entry's content (part of its key)."""
    options = {
        "name": source_cfg.name,
        "format": source_cfg.format,
        "image_root": image_root,
        "strip_image_prefix": source_cfg.strip_image_prefix,
        "move_image_to_start": source_cfg.move_image_to_start,
        "allow_absolute_image_paths": allow_absolute_image_paths,
        "check_images": check_images,
        "max_examples": max_examples,
    }
    if check_images in ("verify", "decode"):  # what a header check accepts is part of the entry
        options["image_limits"] = asdict(limits)
    if max_record_bytes != MAX_RECORD_BYTES:  # the default keeps the entries written before the setting existed
        options["max_record_bytes"] = max_record_bytes
    if text_limits != TextLimits():  # likewise
        options["text_limits"] = asdict(text_limits)
    if not unique_ids:
        options["repeated_ids"] = "drop_exact_duplicates" if drop_exact_duplicates else "keep"
    return options


def load_source(
    source_cfg: SourceConfig,
    *,
    mode: str = "skip",
    cache_dir: str | None = None,
    check_images: str = "verify",
    max_examples: int = 5,
    refresh: bool = False,
    allow_absolute_image_paths: bool = False,
    image_limits: "ImageLimits | None" = None,
    max_record_bytes: int = MAX_RECORD_BYTES,
    text_limits: TextLimits | None = None,
    unique_ids: bool = True,
    drop_exact_duplicates: bool = False,
    num_proc: int = 1,
) -> SourceData:
    """Read, convert and validate one source, through the Arrow cache.

    Args:
        source_cfg: the source.
        mode: ``skip`` (leave bad records out, count them in the report) or ``strict``
            (raise at the first problem).
        cache_dir: cache folder; ``None`` = :func:`~mmtune.data.config.default_cache_dir`.
        check_images: ``verify`` | ``exists`` | ``none`` (see ``ValidationConfig``).
        max_examples: example ids kept per problem class.
        refresh: rebuild the cache entry even if one exists.
        allow_absolute_image_paths: accept absolute image paths outside the image root
            (see :mod:`mmtune.data.paths`).
        image_limits: largest images accepted by the ``verify`` / ``decode`` checks (the
            model's ``model.image_limits``; default: the defaults); others are ``image_too_large``.
        max_record_bytes: largest record read (``data.validation.max_record_bytes``); a longer
            JSONL line is a ``record_too_large`` problem, skipped without being held whole.
        unique_ids: a repeated id is a ``duplicate_id`` problem (an evaluation file, whose
            ids name result rows). ``False`` (training data, :func:`load_training_source`):
            every record is kept under a unique key and the report counts the repeats
            (:mod:`mmtune.data.keys`).
        drop_exact_duplicates: with ``unique_ids=False``, leave out records equal to an
            earlier one (same id, images and conversation), counted in the report.
        num_proc: processes that read a large training source (:mod:`mmtune.data.parallel_read`);
            the entry does not depend on it.

    Raises:
        FileNotFoundError: the data file does not exist.
        DataValidationError: strict mode and a problem (also when the problem was found
            by an earlier cached run), or a broken JSON list in any mode.
    """
    _check_source_arguments(source_cfg, mode, check_images)
    path = source_cfg.path
    image_root = os.path.abspath(source_cfg.image_root) if source_cfg.image_root else None
    limits = image_limits or ImageLimits()
    cache_dir = cache_dir or default_cache_dir()
    ctx = _context(source_cfg.format, source_cfg.name, image_rules(source_cfg, allow_absolute_image_paths, cache_dir),
                   source_cfg.move_image_to_start)
    text_limits = text_limits or TextLimits()
    options = _entry_options(source_cfg, image_root, allow_absolute_image_paths, check_images, max_examples, limits,
                             max_record_bytes, unique_ids, drop_exact_duplicates, text_limits)
    arrow_path, report_path = entry_paths(cache_dir, source_cfg.name, cache_key(path, options))
    hit = None if refresh else open_entry(arrow_path, report_path)
    if hit is not None:
        dataset, report_dict = hit
        report = ValidationReport.from_dict(report_dict)
        if mode == "strict" and report.first_problem:
            raise DataValidationError(f"{report.first_problem} (found when the cache was built: {report_path})")
    else:
        report = _build(source_cfg, ctx, mode, ImageChecker(check_images, limits), max_examples, arrow_path,
                        report_path, max_record_bytes, text_limits, unique_ids=unique_ids,
                        drop_exact_duplicates=drop_exact_duplicates, images=EmbeddedImages(embedded_images_dir(cache_dir)),
                        num_proc=num_proc)
        dataset = open_entry(arrow_path, report_path)[0]
    return SourceData(source_cfg.name, source_cfg, DialogueSequence(dataset), report, arrow_path)


def _check_source_arguments(source_cfg: SourceConfig, mode: str, check_images: str) -> None:
    """:func:`load_source`'s refusals: an unknown mode, image check or format, a missing input."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown: use skip or strict")
    if check_images not in IMAGE_CHECKS:
        raise ValueError(f"check_images={check_images!r} is unknown: use one of {', '.join(IMAGE_CHECKS)}")
    try:
        get_format(source_cfg.format)
    except ValueError as err:
        raise ValueError(f"source {source_cfg.name!r}: {err}") from None
    path = source_cfg.path
    if not (os.path.isfile(path) or (is_table_input(path) and input_files(path))):
        raise FileNotFoundError(
            f"source {source_cfg.name!r}: data file {path!r} does not exist "
            + ("or holds no Parquet / Arrow / JSONL shard " if is_table_input(path) else "")
            + "(set the source's path, or MMTUNE_DATA_ROOT for the shipped configs)"
        )


def _explain(problem: Problem, ctx: ConvertContext) -> Problem:
    """A missing image's problem with the path tried and how it was built."""
    if problem.code != "missing_image":
        return problem
    how = ctx.origins.get(problem.detail)
    return replace(problem, detail=f"tried {problem.detail}, built as {how}") if how else problem


def _records(path: str, images: EmbeddedImages, max_record_bytes: int, wanted: Callable[[int], bool] | None = None):
    """``(index, record, problem)`` of a JSON / JSONL file or a tabular input (:mod:`mmtune.data.tables`);
    ``wanted``: the positions whose records are decoded (where the format allows skipping the others)."""
    if is_table_input(path):
        return iter_table_records(path, images, max_record_bytes, wanted)
    return iter_records(path, max_record_bytes, wanted)


def _checked_records(source_cfg: SourceConfig, ctx: ConvertContext, checker: ImageChecker, limit: int | None = None,
                     max_record_bytes: int = MAX_RECORD_BYTES, text_limits: TextLimits | None = None,
                     unique_ids: bool = True, images: EmbeddedImages | None = None,
                     wanted: Callable[[int], bool] | None = None,
                     ) -> Iterator[tuple[int, Dialogue | None, list[Problem]]]:
    """``(position, dialogue, problems)`` of every record of the source, in file order: each
    record converted and checked (:func:`check_dialogue`, and with ``unique_ids`` a repeated
    id as ``duplicate_id``); ``dialogue`` is None when the record could not be converted.
    ``limit``: only the first records. ``wanted``: only the records at the positions it
    accepts are converted and yielded (the others are parsed, to find where records are)."""
    seen: set[str] = set()
    fmt = get_format(source_cfg.format)
    images = images or EmbeddedImages(embedded_images_dir(None))
    for position, (index, obj, problem) in enumerate(_records(source_cfg.path, images, max_record_bytes, wanted)):
        if limit is not None and index >= limit:
            return
        if wanted is not None and not wanted(position):
            continue
        dialogue = None
        if problem is not None:
            problems = [problem]
        else:
            try:
                dialogue, problems = fmt.convert(obj, index, ctx)
            except RecursionError:  # parsed, but too deep for the conversion (e.g. a nested id)
                dialogue, problems = None, [Problem("too_deep", f"#{index}", index, None, "while converting")]
            if dialogue is not None:
                problems = [_explain(p, ctx) for p in check_dialogue(dialogue, index, checker, text_limits)]
                if unique_ids and dialogue.id in seen:
                    problems.append(Problem("duplicate_id", dialogue.id, index, None, "id seen earlier"))
                if unique_ids:
                    seen.add(dialogue.id)
            if problems and fmt.system_first(obj):
                problems = [replace(p, system_first=True) for p in problems]
        yield position, dialogue, problems


def _build(source_cfg, ctx, mode, checker, max_examples, arrow_path, report_path,
           max_record_bytes: int, text_limits: TextLimits | None = None, *, unique_ids: bool = True,
           drop_exact_duplicates: bool = False, images: EmbeddedImages | None = None,
           num_proc: int = 1) -> ValidationReport:
    path = source_cfg.path

    def new_report() -> ValidationReport:
        return ValidationReport(source_cfg.name, path, source_cfg.format, checker.level, max_examples)

    def records(wanted: Callable[[int], bool] | None = None):
        return _checked_records(source_cfg, ctx, checker, max_record_bytes=max_record_bytes, text_limits=text_limits,
                                unique_ids=unique_ids, images=images, wanted=wanted)

    files = input_files(path) if is_table_input(path) else [path]
    if (num_proc > 1 and not unique_ids and not drop_exact_duplicates
            and parallel_read.input_bytes(files) >= parallel_read.MIN_PARALLEL_BYTES):
        job = parallel_read.ReadJob(records, num_proc, mode, path, new_report, f"{arrow_path}.tmp-{os.getpid()}")
        return parallel_read.read_in_parallel(job, arrow_path, report_path, max_examples)
    report = new_report()
    writer = CacheWriter(arrow_path, report_path)
    keys = RecordKeys(max_examples)
    try:
        for position, dialogue, problems in records():
            if problems:
                if mode == "strict":
                    raise DataValidationError(problems[0].message(path))
                report.add_skipped(problems)
                continue
            key, exact = keys.add(dialogue, position)
            if exact and drop_exact_duplicates:
                report.add_dropped()
                continue
            report.add_kept(dialogue)
            writer.add_dialogue(dialogue, key)
        report.add_repeats(keys.repeated, keys.exact, keys.examples)
        writer.commit(report.to_dict())
    except BaseException:
        writer.abort()
        raise
    return report


def read_source(
    source_cfg: SourceConfig,
    *,
    check_images: str = "none",
    allow_absolute_image_paths: bool = False,
    image_limits: "ImageLimits | None" = None,
    limit: int | None = None,
    max_record_bytes: int = MAX_RECORD_BYTES,
    text_limits: TextLimits | None = None,
) -> list[tuple[Dialogue | None, list[Problem]]]:
    """Every record of one source converted and checked as :func:`load_source` does, without
    the Arrow cache: ``(dialogue, problems)`` per record in file order (``dialogue`` None when
    the record could not be converted; ``problems`` empty for a good record).

    For readers that must refuse a file with any bad record rather than skip it (evaluation
    benchmarks: a dropped item would change the score). ``limit``: only the first records.

    Raises:
        DataValidationError: the file's JSON list structure is broken (see :func:`iter_json_array`).
    """
    if check_images not in IMAGE_CHECKS:
        raise ValueError(f"check_images={check_images!r} is unknown: use one of {', '.join(IMAGE_CHECKS)}")
    ctx = _context(source_cfg.format, source_cfg.name, image_rules(source_cfg, allow_absolute_image_paths),
                   source_cfg.move_image_to_start)
    return [(dialogue, problems) for _, dialogue, problems in _checked_records(
        source_cfg, ctx, ImageChecker(check_images, image_limits), limit, max_record_bytes, text_limits)]


def load_training_source(source_cfg: SourceConfig, data_cfg: DataConfig, *, refresh: bool = False,
                         image_limits: "ImageLimits | None" = None, num_proc: int | None = None) -> SourceData:
    """One training source with its data config's validation and cache settings (and the
    model's image limits): every record kept under a unique key, repeated ids counted in
    the report (:mod:`mmtune.data.keys`), read on ``num_proc`` processes (default:
    ``data.num_proc``, else the cores this process may use). Training, ``mmtune plan`` and ``mmtune data check``
    read sources through it, so all three count the same records."""
    v = data_cfg.validation
    return load_source(
        source_cfg,
        mode=v.mode,
        cache_dir=data_cfg.cache_dir,
        check_images=v.check_images,
        max_examples=v.max_examples,
        refresh=refresh,
        allow_absolute_image_paths=data_cfg.allow_absolute_image_paths,
        image_limits=image_limits,
        max_record_bytes=v.max_record_bytes,
        text_limits=TextLimits.of(v),
        unique_ids=False,
        drop_exact_duplicates=v.drop_exact_duplicates,
        num_proc=num_proc or data_cfg.num_proc or parallel_read.available_cores(),
    )


def load_sources(data_cfg: DataConfig, *, refresh: bool = False, image_limits: "ImageLimits | None" = None,
                 num_proc: int | None = None) -> list[SourceData]:
    """Every source of a data config as training reads it (:func:`load_training_source`)."""
    return [load_training_source(s, data_cfg, refresh=refresh, image_limits=image_limits, num_proc=num_proc)
            for s in data_cfg.mixture.sources]


def read_datatxt(path: str) -> list[tuple[str, float]]:
    """InternLM-XComposer2 ``data.txt``: ``(json_path, sample_count_in_thousands)`` per line.

    Relative JSON paths are taken relative to the ``data.txt`` folder. Blank lines and
    ``#`` comments are ignored.

    Raises:
        DataValidationError: a line does not have a path and a number.
    """
    entries, problems = [], []
    base = os.path.dirname(os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                count = float(parts[1])
            except ValueError:
                problems.append(f"{path}:{n}: expected 'path count_in_thousands', got {line!r}")
                continue
            entries.append((parts[0] if os.path.isabs(parts[0]) else os.path.join(base, parts[0]), count))
    if problems:
        raise DataValidationError("invalid data.txt:\n  " + "\n  ".join(problems))
    return entries


def sources_from_datatxt(path: str, *, image_root: str | None = None, prefix: str = "xc2") -> list[SourceConfig]:
    """One ``xcomposer2`` source per ``data.txt`` line, drawing ``count * 1000`` samples.

    The XComposer2 scripts use the count as the number of samples taken from each file
    per epoch; here it becomes ``SourceConfig.num_samples`` (fewer = fixed subset, more =
    repeats), which the mixture honours when ``weights`` is unset.
    """
    return [
        SourceConfig(
            name=f"{prefix}_{i}_{os.path.splitext(os.path.basename(p))[0]}",
            format="xcomposer2",
            path=p,
            image_root=image_root,
            num_samples=int(round(count * 1000)),
        )
        for i, (p, count) in enumerate(read_datatxt(path))
    ]


__all__ = [
    "LLAVA_PLACEHOLDER",
    "MMDU_PLACEHOLDER",
    "ROLE_MAP",
    "iter_json_array",
    "iter_jsonl",
    "iter_records",
    "surrogate_problem",
    "convert_record",
    "DialogueSequence",
    "SourceData",
    "image_rules",
    "load_source",
    "load_training_source",
    "load_sources",
    "read_source",
    "read_datatxt",
    "sources_from_datatxt",
]

"""Typed schema of the ``data/`` config group: sources, their mixture, validation, stacking.

A ``configs/data/<name>.yaml`` file is a :class:`DataConfig`; an unknown key fails when
the file is merged into the schema (:func:`load_data_config`). Semantic checks that
OmegaConf cannot express (a format name, a weight for a source that does not exist)
live in :meth:`DataConfig.validate`, which collects every problem and raises once.

Example (``configs/data/mmdu_45k.yaml``)::

    mixture:
      sources:
        - name: mmdu_45k
          format: mmdu
          path: ${oc.env:MMTUNE_DATA_ROOT,data}/mmdu/mmdu-45k.json
          image_root: ${oc.env:MMTUNE_DATA_ROOT,data}/mmdu/mmdu-45k_pics
"""

# No ``from __future__ import annotations``: OmegaConf reads these annotations at run
# time to type-check merged YAML, and it understands ``Optional[...]`` best.
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

MODES = ("skip", "strict")
IMAGE_CHECKS = ("verify", "decode", "exists", "none")
MIX_BY = ("samples", "tokens")
STRATEGIES = ("custom", "add_to_pool", "continue_training")


class ConfigError(ValueError):
    """A data config is invalid; the message lists every problem with its config key."""


@dataclass
class SourceConfig:
    """One named data source: a file in one of the supported formats."""

    name: str = "???"
    """Name used in reports, in ``MixtureConfig.weights`` and as ``Dialogue.source``."""

    format: str = "???"
    """File format, a registered one (:mod:`mmtune.data.formats`): ``llava`` (llava-665k),
    ``mmdu`` (MMDU benchmark / MMDU-45k), ``xcomposer2`` (InternLM-XComposer2 fine-tune
    JSON) or ``messages`` (JSONL of OpenAI-style ``messages`` with interleaved image parts)."""

    path: str = "???"
    """The data file: a JSON list or a JSONL file (detected from its first character)."""

    image_root: Optional[str] = None
    """Directory image paths are relative to, and that they must stay inside. Rooted
    paths in the data (the MMDU benchmark's ``/mmdu_pics/x.jpg``) are joined under it
    too, so for the benchmark this is the folder that contains ``mmdu_pics/`` (format
    ``messages`` does not join absolute paths: they need
    ``data.allow_absolute_image_paths``). ``None``: the data file's directory."""

    strip_image_prefix: Optional[str] = None
    """A prefix removed from every image path before joining with ``image_root``, e.g.
    ``/mmdu_pics/`` to point ``image_root`` at the pictures folder itself."""

    num_samples: Optional[int] = None
    """Records drawn from this source per epoch when ``MixtureConfig.weights`` is unset:
    fewer than its size keeps a fixed seeded subset (a "slice"), more repeats records
    (up-sampling). ``None``: every record once."""

    move_image_to_start: Optional[bool] = None
    """``llava`` only: move the ``<image>`` placeholder to the start of its turn followed
    by a newline and strip that turn, as LLaVA-1.5's own preprocessing does
    (``preprocess_multimodal``). ``None`` (default): on for ``llava``, off for every
    other format; ``false`` keeps the placeholder where it was."""


@dataclass
class MixtureConfig:
    """How several sources are combined into one training stream."""

    sources: List[SourceConfig] = field(default_factory=list)
    """The named sources, in a fixed order (global index = source offset + record index)."""

    weights: Optional[Dict[str, float]] = None
    """Relative share of each source (by name) in an epoch, measured in ``by`` units.
    ``None``: each source contributes ``num_samples`` (or all) of its records."""

    by: str = "samples"
    """What ``weights`` are shares of: ``samples`` or estimated ``tokens``
    (characters / 4 + ``tokens_per_image`` per image: cheap, no tokenizer needed)."""

    epoch_size: Optional[int] = None
    """Samples per epoch when ``weights`` is set; ``None``: the sum of the source sizes."""

    tokens_per_image: int = 576
    """Token estimate per image for ``by: tokens`` and stacking budgets (576 = LLaVA-1.5
    at 336 px; InternLM-XComposer2-VL uses 1225)."""

    seed: int = 0
    """Seed of subsets, repeats and the per-epoch order."""

    strategy: str = "custom"
    """Label of the paper's data strategy: ``add_to_pool`` (MMDU-45k added to the full
    llava-665k), ``continue_training`` (MMDU-45k plus a slice of llava-665k, meant to
    start from an already fine-tuned model) or ``custom``. Recorded in run metadata."""


@dataclass
class ValidationConfig:
    """How records are checked while they are read."""

    mode: str = "skip"
    """``skip``: drop bad records and report exactly how many and why. ``strict``: raise at
    the first problem, naming file, record id, turn index and the fix. Also decides what an
    image that fails to decode during training does (unless ``collator.image_errors`` is set)."""

    check_images: str = "verify"
    """``verify``: the file exists and PIL can open and verify it (header-level, cheap);
    ``decode``: every image is decoded in full, so a file cut short after its header is
    found here and not mid-training; ``exists``: only existence; ``none``: no image checks.
    Images that fail to decode during training follow ``mode`` (see
    ``collator.image_errors``)."""

    max_examples: int = 5
    """Example record ids kept per problem class in the report."""

    drop_exact_duplicates: bool = False
    """Leave out a training record equal to an earlier one of its source (same id, same
    images, same conversation), counted in the report. Off: such records are kept, as the
    published mixes hold them (llava-665k is trained with them). A repeated id with another
    conversation is never dropped: every such record is trained (see :mod:`mmtune.data.keys`)."""

    max_record_bytes: int = 256 * 1024 * 1024
    """Largest record read, in bytes (256 MiB): a JSONL line above it is skipped as
    ``record_too_large`` without ever being held in memory whole (format detection too);
    a JSON list element above it fails the file, whose structure cannot then be followed.
    Reading a record takes a few times its size in memory while it is parsed."""

    max_turn_chars: int = 262_144
    """Most characters of text in one turn (256 Ki, about 60k tokens, far past any training
    window): a longer turn is ``text_too_long`` and its record is left out (``skip``) or
    refused (``strict``) before anything tokenises it, so one huge turn cannot grow memory."""

    max_record_chars: int = 1_048_576
    """Most characters of text in one record, all turns together (1 Mi): the same for a
    record of many long turns."""


@dataclass
class StackingConfig:
    """Concatenate dialogues of one source into longer ones (MMDU paper, appendix C.1)."""

    enabled: bool = False
    """Off by default: stacking changes what a sample is."""

    sources: Optional[List[str]] = None
    """Source names to stack; ``None``: every source."""

    max_images: int = 20
    """Image budget of a stacked dialogue (the MMDU benchmark goes up to 20)."""

    max_tokens: int = 16384
    """Estimated token budget of a stacked dialogue (the paper trains at up to 16k)."""

    seed: int = 0
    """Seed of the order dialogues are drawn in before greedy stacking."""


@dataclass
class DataConfig:
    """The ``data/`` config group."""

    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    """Sources and how they are mixed."""

    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """Record checks and what to do with bad records."""

    stacking: StackingConfig = field(default_factory=StackingConfig)
    """Optional dialogue stacking."""

    allow_absolute_image_paths: bool = False
    """Accept absolute image paths that lie outside a source's ``image_root`` (the
    ``messages`` format's real paths, ``/home/me/x.jpg``). Off: such a path is a
    ``path_outside_root`` problem. Relative and rooted paths must stay inside the root
    either way (see :mod:`mmtune.data.paths`)."""

    cache_dir: Optional[str] = None
    """Where parsed, validated sources are cached as Arrow files. ``None``:
    ``$MMTUNE_CACHE_DIR/data`` or ``~/.cache/mmtune/data``."""

    files: List[str] = field(default_factory=list)
    """Your own data files, JSON or JSONL, each one source named after its file
    (``chat.json`` -> ``chat``) in the format detected from its first records, as
    ``mmtune data check FILE`` detects it. When set, these are the sources:
    ``mixture.sources`` of the data group is replaced (the run prints it). Without
    ``ratios`` each file's records are used once per epoch."""

    ratios: List[float] = field(default_factory=list)
    """Share of each of ``files`` in an epoch, in their order (``[3, 1]``: three samples
    of the first for one of the second), counted in ``mixture.by`` units; the epoch
    holds ``mixture.epoch_size`` samples (default: all records). A small file given a
    large share is repeated (``mmtune plan`` says how often). Empty: each file once."""

    num_proc: Optional[int] = None
    """Forked processes that read a large source into the cache (rank 0 reads while the other
    ranks wait; ``None``: the cores it may use) and that measure lengths on each rank
    (``None``: its CPU affinity divided by the ranks on the node). Neither the cache entries
    nor the lengths depend on it."""

    image_root: Optional[str] = None
    """The image root of the sources made from ``files`` (``None``: each file's own
    folder). Image paths in the files are relative to it and must stay inside it."""

    def validate(self) -> None:
        """Check everything OmegaConf cannot; raise one :class:`ConfigError` listing all."""
        from mmtune.data.formats import format_names, get_format

        problems = []
        formats = format_names()
        mix = self.mixture
        if not mix.sources:
            problems.append("data.mixture.sources is empty: list at least one source")
        names = [s.name for s in mix.sources]
        for i, s in enumerate(mix.sources):
            key = f"data.mixture.sources[{i}]"
            for attr in ("name", "format", "path"):
                if getattr(s, attr) in (None, "", "???"):
                    problems.append(f"{key}.{attr} is missing")
            if s.format not in formats and s.format != "???":
                problems.append(f"{key}.format={s.format!r} is unknown: use one of {', '.join(formats)}")
            if names.count(s.name) > 1:
                problems.append(f"{key}.name={s.name!r} is used by several sources: names must be unique")
            if s.num_samples is not None and s.num_samples < 0:
                problems.append(f"{key}.num_samples={s.num_samples} must be >= 0")
            if s.num_samples is not None and mix.weights is not None:
                problems.append(
                    f"{key}.num_samples is set together with data.mixture.weights: use one of the two"
                )
            if s.move_image_to_start is True and s.format in formats and get_format(s.format).image_to_start is None:
                movable = [name for name in formats if get_format(name).image_to_start is not None]
                problems.append(f"{key}.move_image_to_start applies to format {' or '.join(movable)} only")
        if self.ratios and len(self.ratios) != len(self.files):
            problems.append(f"data.ratios has {len(self.ratios)} value(s) for {len(self.files)} data.files: give one "
                            "share per file, in the same order")
        if self.ratios and not self.files:
            problems.append("data.ratios is set without data.files: mix a data group's sources with data.mixture.weights")
        if mix.weights is not None:
            for name, w in mix.weights.items():
                if name not in names:
                    problems.append(f"data.mixture.weights has {name!r}, which is not a source name ({names})")
                if not (math.isfinite(w) and w >= 0):  # NaN passes "w < 0"
                    problems.append(f"data.mixture.weights.{name}={w} must be a finite number >= 0")
            if not sum(mix.weights.values()) > 0:
                problems.append("data.mixture.weights sum to 0: give at least one source a positive weight")
        if mix.by not in MIX_BY:
            problems.append(f"data.mixture.by={mix.by!r} is unknown: use samples or tokens")
        if mix.strategy not in STRATEGIES:
            problems.append(f"data.mixture.strategy={mix.strategy!r} is unknown: use one of {', '.join(STRATEGIES)}")
        if mix.epoch_size is not None and mix.epoch_size <= 0:
            problems.append(f"data.mixture.epoch_size={mix.epoch_size} must be > 0")
        if mix.tokens_per_image < 0:
            problems.append("data.mixture.tokens_per_image must be >= 0")
        if self.validation.mode not in MODES:
            problems.append(f"data.validation.mode={self.validation.mode!r} is unknown: use skip or strict")
        if self.validation.check_images not in IMAGE_CHECKS:
            problems.append(
                f"data.validation.check_images={self.validation.check_images!r} is unknown: "
                f"use one of {', '.join(IMAGE_CHECKS)}"
            )
        if self.num_proc is not None and self.num_proc < 1:
            problems.append(f"data.num_proc={self.num_proc} must be >= 1 (or null: the cores this rank may use)")
        if self.validation.max_examples < 0:
            problems.append(f"data.validation.max_examples={self.validation.max_examples} must be >= 0")
        for key in ("max_turn_chars", "max_record_chars"):
            if getattr(self.validation, key) < 1:
                problems.append(f"data.validation.{key}={getattr(self.validation, key)} must be >= 1")
        if self.validation.max_record_bytes < 1:
            problems.append(f"data.validation.max_record_bytes={self.validation.max_record_bytes} must be >= 1")
        st = self.stacking
        if st.sources is not None:
            for name in st.sources:
                if name not in names:
                    problems.append(f"data.stacking.sources has {name!r}, which is not a source name ({names})")
        if st.max_images < 1 or st.max_tokens < 1:
            problems.append("data.stacking.max_images and max_tokens must be >= 1")
        if problems:
            raise ConfigError("invalid data config:\n  - " + "\n  - ".join(problems))


def default_cache_dir() -> str:
    """``$MMTUNE_CACHE_DIR/data`` or ``~/.cache/mmtune/data``."""
    base = os.environ.get("MMTUNE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mmtune")
    return os.path.join(base, "data")


def configs_dir() -> Path:
    """The repository's ``configs/`` folder (``$MMTUNE_CONFIG_DIR`` overrides)."""
    if os.environ.get("MMTUNE_CONFIG_DIR"):
        return Path(os.environ["MMTUNE_CONFIG_DIR"])
    local = Path.cwd() / "configs"
    if (local / "data").is_dir():
        return local
    return Path(__file__).resolve().parents[3] / "configs"


def resolve_group_config_path(group: str, name_or_path: str) -> Path:
    """A YAML path as given, or ``configs/<group>/<name>.yaml`` for a bare config name.

    Raises:
        FileNotFoundError: neither exists; the message lists the available names.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    candidate = configs_dir() / group / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if candidate.is_file():
        return candidate
    available = sorted(p.stem for p in (configs_dir() / group).glob("*.yaml"))
    raise FileNotFoundError(
        f"{group} config {name_or_path!r} is neither a file nor a name in {configs_dir() / group} "
        f"(available: {', '.join(available) or 'none'})"
    )


def apply_overrides(cfg: Any, overrides: Optional[List[str]]) -> None:
    """Apply ``key=value`` overrides to an OmegaConf config in place.

    Values are parsed as YAML like Hydra does ("66000" -> int, "null" -> None); list
    elements are addressed by index: ``mixture.sources.1.num_samples=166000``.
    """
    import yaml
    from omegaconf import OmegaConf

    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        OmegaConf.update(cfg, key, yaml.safe_load(value), merge=True)


def resolve_data_config_path(name_or_path: str) -> Path:
    """A YAML path as given, or ``configs/data/<name>.yaml`` (see :func:`resolve_group_config_path`)."""
    return resolve_group_config_path("data", name_or_path)


def load_data_config(name_or_path: str, overrides: Optional[List[str]] = None) -> DataConfig:
    """Load a ``data/`` group YAML (or a full run config with a ``data:`` key) into a DataConfig.

    Args:
        name_or_path: a YAML file or a name under ``configs/data/``.
        overrides: dotlist overrides such as ``validation.mode=strict``.

    Raises:
        omegaconf.errors.ConfigKeyError: an unknown key (the message names it).
        ConfigError: semantic problems, all listed.
    """
    from omegaconf import OmegaConf

    raw = OmegaConf.load(resolve_data_config_path(name_or_path))
    if "data" in raw and "mixture" not in raw:
        raw = raw.data
    cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), raw)
    apply_overrides(cfg, overrides)
    data: Any = OmegaConf.to_object(cfg)
    data.validate()
    return data


__all__ = [
    "ConfigError",
    "SourceConfig",
    "MixtureConfig",
    "ValidationConfig",
    "StackingConfig",
    "DataConfig",
    "default_cache_dir",
    "configs_dir",
    "apply_overrides",
    "resolve_group_config_path",
    "resolve_data_config_path",
    "load_data_config",
]

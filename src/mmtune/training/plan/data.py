"""The data side of the plan: every source loaded through the data layer, one epoch sized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mmtune.training.plan.common import PlanError

__all__ = ["SourcePlan", "DataPlan", "plan_data", "REPEAT_WARNING"]

REPEAT_WARNING = 4.0
"""Times per epoch a record may be drawn to reach a mixture ratio before the plan warns:
a small source seen this often every epoch is learnt by heart rather than from."""


@dataclass
class SourcePlan:
    name: str
    path: str
    format: str
    records: int
    kept: int
    used_per_epoch: int
    images: int
    estimated_tokens: int
    """Estimated tokens of the records used per epoch (data layer's estimate)."""
    report: str


@dataclass
class DataPlan:
    sources: list[SourcePlan]
    strategy: str
    by: str
    weights: Optional[dict[str, float]]
    samples_per_epoch: int
    tokens_per_epoch: int
    images_per_epoch: int
    mean_tokens_per_sample: float
    tokens_source: str
    notes: list[str] = field(default_factory=list)
    """Caveats of the estimate and sources with skipped records (with their reports)."""


def _loaded_sources(data_cfg: Any, *, allow_skipped: bool, image_limits: Any) -> list[Any]:
    """Every source through the data layer (validated, cached).

    Raises:
        PlanError: a source does not load, or records would be skipped for their images
            (unless ``allow_skipped``); every problem in one message.
    """
    from mmtune.data.readers import load_training_source
    from mmtune.data.validation import DataValidationError

    problems: list[str] = []
    loaded = []
    for s in data_cfg.mixture.sources:
        try:
            loaded.append(load_training_source(s, data_cfg, image_limits=image_limits))
        except (FileNotFoundError, DataValidationError) as err:
            problems.append(f"data source {s.name!r}: {err}")
    if problems:
        raise PlanError("\n".join(problems))
    for sd in loaded:
        bad_images = {k: n for k, n in sd.report.skipped.items()
                      if k in ("missing_image", "corrupt_image", "image_too_large")}
        if bad_images and not allow_skipped:
            problems.append(
                f"data source {sd.name!r}: {sum(bad_images.values())} record(s) would be skipped for "
                f"missing or broken images\n{sd.report.render()}"
            )
    if problems:
        raise PlanError("\n".join(problems) + "\n(fix the paths, or pass --allow-skipped to plan anyway)")
    return loaded


def _notes(data_cfg: Any, loaded: list[Any], used: dict[str, int]) -> list[str]:
    """What the plan says about the data beyond its counts: stacking, skipped records, repeated sources."""
    mix = data_cfg.mixture
    notes = []
    if data_cfg.stacking.enabled:
        notes.append("data.stacking is enabled: counts are before stacking (fewer, longer samples in training)")
    notes += [f"source {sd.name!r} skips {sd.report.records_skipped} record(s):\n{sd.report.render()}"
              for sd in loaded if sd.report.records_skipped]
    if mix.weights:
        for sd in loaded:
            times = used[sd.name] / len(sd) if len(sd) else 0.0
            if times >= REPEAT_WARNING:
                notes.append(
                    f"WARNING: source {sd.name!r} has {len(sd):,} record(s) but its ratio draws {used[sd.name]:,} "
                    f"samples per epoch: each record is repeated {times:.1f} times an epoch, which a model "
                    f"memorises. Lower its ratio (data.ratios / data.mixture.weights), set "
                    f"data.mixture.epoch_size, or add data to it")
    return notes


def plan_data(data_cfg: Any, tokens_per_image: Optional[int], *, max_length: Optional[int] = None,
              allow_skipped: bool = False, image_limits: Any = None) -> DataPlan:
    """Load every source through the data layer (validated, cached) and size one epoch.

    Tokens come from the data layer's estimate (characters / 4 + tokens per image),
    capped at ``max_length`` per sample (the collator drops whole trailing turns past
    it); records per source and epoch come from the data layer's
    :func:`~mmtune.data.mixture.mixture_counts`, as the training sampler draws them.
    ``image_limits``: the model's ``model.image_limits``, as training checks them.
    """
    import numpy as np

    loaded = _loaded_sources(data_cfg, allow_skipped=allow_skipped, image_limits=image_limits)
    from mmtune.data.mixture import mixture_counts

    mix = data_cfg.mixture
    tpi = mix.tokens_per_image if tokens_per_image is None else tokens_per_image
    per_source = []
    raw_means = []
    for sd in loaded:
        raw = sd.estimated_tokens(tpi)
        tokens = np.minimum(raw, max_length) if max_length else raw
        per_source.append((sd, len(sd), int(tokens.sum()), int(sd.num_images.sum())))
        raw_means.append(float(raw.mean()) if len(sd) else 0.0)
    # Records per source and epoch exactly as the training sampler draws them.
    try:
        counts = mixture_counts(mix, [size for _, size, _, _ in per_source], raw_means)
    except ValueError as err:
        raise PlanError(f"data.mixture: {err}") from err
    used = {sd.name: c for (sd, *_), c in zip(per_source, counts)}

    notes = _notes(data_cfg, loaded, used)
    sources = []
    tokens_epoch = 0
    images_epoch = 0
    for sd, size, tok, img in per_source:
        u = used[sd.name]
        frac = u / size if size else 0.0
        tokens_epoch += int(round(tok * frac))
        images_epoch += int(round(img * frac))
        sources.append(SourcePlan(sd.name, sd.config.path, sd.config.format, sd.report.records_read, size, u, img,
                                  int(round(tok * frac)), sd.report.render()))
    samples = sum(used.values())
    return DataPlan(
        sources=sources,
        strategy=mix.strategy,
        by=mix.by,
        weights=dict(mix.weights) if mix.weights else None,
        samples_per_epoch=samples,
        tokens_per_epoch=tokens_epoch,
        images_per_epoch=images_epoch,
        mean_tokens_per_sample=tokens_epoch / samples if samples else 0.0,
        tokens_source=f"data layer estimate: characters/4 + {tpi} tokens per image"
        + (f", capped at {max_length} per sample" if max_length else ""),
        notes=notes,
    )

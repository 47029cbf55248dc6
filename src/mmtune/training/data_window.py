"""The training side of ``mmtune data check``: the model and the window a run would use,
composed from ``model=``/``experiment=``/``collator.``/``context.``/``training.`` overrides as
``mmtune train`` composes them, and every dialogue measured against that window
(:func:`mmtune.data.window.window_report`).

The data layer neither composes training configs nor builds models; the ``mmtune``
command hands :func:`training_window` to :func:`mmtune.data.check.run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.data.config import DataConfig
    from mmtune.data.mixture import Mixture
    from mmtune.data.window import WindowReport
    from mmtune.training.config import SFTConfig

__all__ = ["TrainingWindow", "training_window"]


@dataclass
class TrainingWindow:
    """The window of one composed training config."""

    config: "SFTConfig"

    @property
    def image_limits(self) -> Any:
        """``model.image_limits``: the largest images the run decodes, checked while reading."""
        return self.config.model.image_limits

    def measure(self, data: "DataConfig", mixture: "Mixture") -> "WindowReport":
        """Every dialogue of ``mixture`` measured by the run's model against its window.

        Args:
            data: the data config ``mixture`` was read with (its validation mode decides
                what an image the model cannot count does, as in training).
        """
        from mmtune.data.datamodule import length_cache_dir
        from mmtune.data.window import window_report
        from mmtune.models.registry import build_adapter

        cfg = self.config
        c = cfg.collator
        return window_report(build_adapter(cfg.model), mixture, max_length=cfg.context.max_length or c.max_length,
                             truncation=c.truncation, train_on=c.train_on, system_prompt=c.system_prompt,
                             sequence_parallel=cfg.training.sequence_parallel.size, cache_dir=length_cache_dir(data, c),
                             image_errors=c.image_errors or data.validation.mode)


def training_window(overrides: Sequence[str]) -> Optional[TrainingWindow]:
    """The window the ``overrides`` compose to; ``None`` when they name no model
    (neither ``model=``/``model.`` nor ``experiment=``).

    Raises:
        ConfigError, OverrideError: the overrides do not compose or do not validate (every problem listed).
    """
    keys = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    if not any(k in ("model", "experiment") or k.startswith("model.") for k in keys):
        return None
    from mmtune.compose import compose_checked
    from mmtune.training.config import to_sft_config

    return TrainingWindow(to_sft_config(compose_checked(list(overrides), command="mmtune data check")))

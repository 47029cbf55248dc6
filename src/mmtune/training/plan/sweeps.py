"""W&B sweep files as runs to plan: grid points, the recipe each runs, its launcher.

An experiment's own recipe and launcher are typed keys of its config (``recipe``,
``launcher``: :mod:`mmtune.experiment`); ``experiment_recipe`` reads the first before
composing, ``mmtune plan`` reads ``launcher`` from the composed run config."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Optional, Sequence

from mmtune.compose import RECIPES, experiment_recipe

__all__ = ["sweep_grid", "sweep_recipe", "experiment_recipe", "experiment_launcher", "sweep_accelerate_config"]


def sweep_grid(sweep: dict[str, Any] | str | os.PathLike) -> list[list[str]]:
    """Every grid point of a W&B sweep file as a list of Hydra overrides.

    ``parameters`` entries with ``values`` are crossed (W&B's ``grid`` method); entries
    with ``value`` are fixed. Keys are Hydra override keys (``experiment``,
    ``training.lr``, ``+x``); order follows the file.
    """
    if not isinstance(sweep, dict):
        from omegaconf import OmegaConf

        sweep = OmegaConf.to_container(OmegaConf.load(sweep), resolve=False)  # type: ignore[assignment]
    params = sweep.get("parameters") or {}
    if not params:
        raise ValueError("sweep has no `parameters`; a sweep must grid over at least `experiment`")
    method = sweep.get("method", "grid")
    if method != "grid":
        raise ValueError(f"sweep method {method!r}: mmtune's sweeps are grids over table rows (method: grid)")
    axes: list[list[str]] = []
    for key, spec in params.items():
        if not isinstance(spec, dict) or ("values" not in spec and "value" not in spec):
            raise ValueError(f"sweep parameter {key!r} needs `values: [...]` or `value: x`")
        values = spec["values"] if "values" in spec else [spec["value"]]
        axes.append([f"{key}={_override_value(v)}" for v in values])
    return [list(point) for point in itertools.product(*axes)]


def sweep_recipe(sweep: str | os.PathLike) -> str:
    """``sft`` or ``evaluate``: which recipe a sweep's ``program`` runs."""
    from omegaconf import OmegaConf

    program = str(OmegaConf.load(sweep).get("program") or "")
    for name, path in RECIPES.items():
        if program == path:
            return name
    raise ValueError(f"program {program!r} is not one of {sorted(RECIPES.values())}")


def experiment_launcher(overrides: Sequence[str]) -> Optional[str]:
    """Deprecated: the ``launcher`` key of the experiment an ``experiment=`` override picks
    (read it from the composed config: ``cfg.launcher``); ``None`` without one."""
    import warnings

    from mmtune.compose import compose_config, experiment_name

    warnings.warn("experiment_launcher() is deprecated: an experiment's launcher is its typed `launcher` key; "
                  "read cfg.launcher from the composed config", DeprecationWarning, stacklevel=2)
    name = experiment_name(overrides)
    if not name:
        return None
    return compose_config([f"experiment={name}"], "sft").launcher


def sweep_accelerate_config(sweep: str | os.PathLike) -> Optional[str]:
    """The ``--config_file`` an accelerate-launched sweep command passes, if any."""
    from omegaconf import OmegaConf

    command = [str(c) for c in (OmegaConf.to_container(OmegaConf.load(sweep), resolve=False).get("command") or [])]
    if "--config_file" in command[:-1]:
        return command[command.index("--config_file") + 1]
    return None


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)

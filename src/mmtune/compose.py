"""Compose a recipe's Hydra config the way the recipe sees it, without running the recipe.

``mmtune plan``, ``mmtune demo``, bench scripts and tests all build configs here:
``configs/<recipe>.yaml`` with Hydra overrides, after registering the typed schemas, with
no change of working directory and no logging setup (Hydra's compose API).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

__all__ = ["RECIPES", "compose_config"]

#: recipe name -> its script; the name is also the primary config under configs/
RECIPES = {"sft": "recipes/sft.py", "evaluate": "recipes/evaluate.py"}


def compose_config(overrides: Sequence[str], config_name: str = "sft") -> Any:
    """Compose ``configs/<config_name>.yaml`` with Hydra ``overrides``.

    ``config_name`` is ``sft`` (recipes/sft.py) or ``evaluate`` (recipes/evaluate.py,
    whose primary config has no ``experiment`` default: ``experiment=x`` is passed on
    as ``+experiment=x``, and ``+experiment=x`` to ``sft`` as ``experiment=x``).

    Returns:
        The composed ``DictConfig``, interpolations unresolved.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from mmtune.data.config import configs_dir
    from mmtune.evaluation.config import register_configs as register_eval
    from mmtune.training.config import register_configs

    register_configs()
    register_eval()
    if config_name == "evaluate":
        overrides = [f"+{o}" if o.startswith("experiment=") else o for o in overrides]
    else:
        overrides = [o[1:] if o.startswith("+experiment=") else o for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(configs_dir()).resolve()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))

"""The experiments under configs/experiment/ by recipe, read without composing them.

Test tooling, outside the installed package: parametrised tests list the experiments of
one recipe at collection time, where composing all of them through Hydra would cost
seconds. The recipe is the experiment's typed ``recipe`` key, taken from the file itself or
else from the parent experiment its ``defaults`` names (as Hydra merges them: the file's
own key wins). ``tests/test_experiment.py`` checks this agrees with the composed configs.
"""

from __future__ import annotations

from pathlib import Path

import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def declared_recipe(name: str, root: Path = CONFIGS) -> str:
    """``sft`` or ``evaluate``: the ``recipe`` experiment ``name`` states or inherits (``sft`` if none)."""
    data = yaml.safe_load((root / "experiment" / f"{name}.yaml").read_text(encoding="utf-8")) or {}
    if "recipe" in data:
        return str(data["recipe"])
    parents = [e for e in data.get("defaults") or [] if isinstance(e, str) and e != "_self_"]
    return declared_recipe(parents[-1], root) if parents else "sft"


def experiments(recipe: str, root: Path = CONFIGS, pattern: str = "*") -> list[str]:
    """The names of the experiments whose recipe is ``recipe``, sorted."""
    return sorted(p.stem for p in (root / "experiment").glob(f"{pattern}.yaml") if declared_recipe(p.stem, root) == recipe)

"""What an experiment declares about how it runs: the recipe that runs it and its launcher.

Every experiment file (``configs/experiment/<name>.yaml``) states two typed top-level keys,
fields of both :class:`~mmtune.training.config.SFTConfig` and
:class:`~mmtune.evaluation.config.EvaluateConfig`:

- ``recipe``: :class:`Recipe`, ``sft`` (``recipes/sft.py``, ``mmtune train``) or
  ``evaluate`` (``recipes/evaluate.py``, ``mmtune evaluate``). Each entry point refuses an
  experiment of the other recipe and names the command that runs it;
- ``launcher``: the accelerate config file (``accelerate launch --config_file <launcher>``)
  the experiment's command uses, relative to the project; ``null`` for one process or
  plain DDP. ``mmtune plan`` plans a run for it unless ``--accelerate-config`` says otherwise.

The file's leading comment still shows the command for a reader; nothing parses it. This
module sits below the config schemas and imports nothing from mmtune.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Recipe"]


class Recipe(str, Enum):
    """The recipe that runs a config; the value is also the primary config's name under
    ``configs/`` (``configs/sft.yaml``, ``configs/evaluate.yaml``)."""

    sft = "sft"
    evaluate = "evaluate"


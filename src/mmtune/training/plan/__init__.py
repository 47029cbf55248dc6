"""``mmtune plan``: resolve a run (or a whole sweep) and estimate its cost, without loading weights.

For each run it prints the model and its parameter counts (the model is built on the
``meta`` device from its config, so no weight is read and no memory is used), the data
sources with their record counts and validation report, the mixture, the context
window and RoPE scaling, LoRA or full fine-tuning, the distributed engine, the number of
optimizer steps, the estimated training tokens, and GPU-hours and memory per GPU for a
chosen GPU type. It fails early (exit code 1, with the data layer's report) when a data
file is missing or records would be skipped for missing or broken images.

The modules, in reading order: :mod:`~.gpus` (the GPU table), :mod:`~.model`
(parameter counts: the family's adapter builds the meta-device model and names its
module groups), :mod:`~.data` (one epoch through the data layer), :mod:`~.cost` (the
cost model, its formulas in its docstring), :mod:`~.run` (a training run),
:mod:`~.evaluation` (an evaluation run: each benchmark counts its own work),
:mod:`~.sweeps` (sweep and experiment files) and :mod:`~.cli` (``mmtune plan``).
"""

from mmtune.compose import compose_config as compose_run  # the recipes' own composition
from mmtune.training.plan.cli import main
from mmtune.training.plan.common import PlanError
from mmtune.training.plan.cost import CostEstimate, estimate_cost
from mmtune.training.plan.data import DataPlan
from mmtune.training.plan.evaluation import EvalPlan, plan_evaluation
from mmtune.training.plan.gpus import GPU_TYPES, GpuType
from mmtune.training.plan.model import ParamCounts, count_parameters
from mmtune.training.plan.run import RunPlan, plan_run
from mmtune.training.plan.sweeps import experiment_recipe, sweep_accelerate_config, sweep_grid, sweep_recipe

__all__ = [
    "GPU_TYPES",
    "GpuType",
    "ParamCounts",
    "DataPlan",
    "CostEstimate",
    "RunPlan",
    "PlanError",
    "compose_run",
    "sweep_grid",
    "sweep_accelerate_config",
    "sweep_recipe",
    "experiment_recipe",
    "plan_evaluation",
    "EvalPlan",
    "count_parameters",
    "estimate_cost",
    "plan_run",
    "main",
]

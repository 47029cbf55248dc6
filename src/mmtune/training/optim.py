"""Freezing and optimizer parameter groups per module group.

A VLM has three parts trained differently: the vision tower (usually frozen), the
projector (trained, often with its own learning rate) and the language model (full or
LoRA); a model that also writes images has a fourth, ``frozen`` (its generation modules, which
an image-text step never runs), never trained. :func:`apply_freezing` sets ``requires_grad``
from ``training.<group>.train``; :func:`param_groups` builds AdamW groups with a learning rate per module group and no
weight decay on norm weights and biases (decaying them only hurts: they are scales
and offsets, not features).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from mmtune.models.base import ModuleGroups

if TYPE_CHECKING:  # pragma: no cover
    from mmtune.training.config import TrainingConfig

__all__ = ["GROUP_NAMES", "group_of_parameters", "apply_freezing", "param_groups", "build_optimizer", "count_parameters"]

GROUP_NAMES = ("vision", "projector", "language_model")


def group_of_parameters(model: nn.Module, groups: ModuleGroups) -> dict[str, str]:
    """Map every parameter name of ``model`` to its group name.

    Raises:
        ValueError: a parameter belongs to no group, or to two (the adapter's
            ``module_groups`` must partition the model).
    """
    owner: dict[int, str] = {}
    clashes: list[str] = []
    for group_name in (*GROUP_NAMES, "frozen"):
        for module in getattr(groups, group_name):
            for param in module.parameters():
                if id(param) in owner and owner[id(param)] != group_name:
                    clashes.append(f"a parameter is in both {owner[id(param)]} and {group_name}")
                owner[id(param)] = group_name
    mapping: dict[str, str] = {}
    missing: list[str] = []
    for name, param in model.named_parameters():
        if id(param) in owner:
            mapping[name] = owner[id(param)]
        else:
            missing.append(name)
    if missing or clashes:
        raise ValueError(
            "adapter.module_groups(model) must put every parameter in exactly one group "
            f"(vision/projector/language_model/frozen); not in any group: {missing[:8]}{' ...' if len(missing) > 8 else ''}; "
            f"{'; '.join(clashes[:4])}"
        )
    return mapping


def apply_freezing(model: nn.Module, groups: ModuleGroups, training: "TrainingConfig", *, lora: bool = False) -> None:
    """Set ``requires_grad`` per group from ``training.<group>.train``; the ``frozen`` group never trains.

    With ``lora`` the language model's base weights stay frozen (peft froze them) and
    only its LoRA parameters follow ``training.language_model.train``.
    """
    mapping = group_of_parameters(model, groups)
    for name, param in model.named_parameters():
        group = mapping[name]
        if group == "frozen":  # never trained (ModuleGroups.frozen)
            param.requires_grad_(False)
            continue
        train = getattr(training, group).train
        if lora and group == "language_model":
            param.requires_grad_(train and "lora_" in name)
        elif lora and "lora_" in name:
            param.requires_grad_(False)  # LoRA is for the language model only
        else:
            param.requires_grad_(train)


def _no_decay(name: str, param: nn.Parameter) -> bool:
    # 1-D tensors are biases and norm scales; embeddings/matrices decay.
    return param.ndim < 2 or name.endswith(".bias") or "norm" in name.lower()


def param_groups(model: nn.Module, groups: ModuleGroups, training: "TrainingConfig") -> list[dict]:
    """AdamW parameter groups: one (decay, no-decay) pair per trained module group.

    Each group dict carries ``name`` (e.g. ``projector/no_decay``) for logging.
    Frozen parameters are left out.
    """
    mapping = group_of_parameters(model, groups)
    buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            buckets.setdefault((mapping[name], _no_decay(name, param)), []).append(param)
    result = []
    for group_name in GROUP_NAMES:
        cfg = getattr(training, group_name)
        lr = cfg.lr if cfg.lr is not None else training.lr
        wd = cfg.weight_decay if cfg.weight_decay is not None else training.weight_decay
        for no_decay in (False, True):
            params = buckets.get((group_name, no_decay))
            if params:
                result.append({"params": params, "lr": lr, "weight_decay": 0.0 if no_decay else wd,
                               "name": f"{group_name}/{'no_decay' if no_decay else 'decay'}"})
    if not result:
        raise ValueError("no trainable parameters: check training.<group>.train and peft settings")
    return result


def build_optimizer(groups: list[dict], training: "TrainingConfig") -> torch.optim.Optimizer:
    """AdamW over ``groups`` (their own ``lr``/``weight_decay`` override the defaults)."""
    return torch.optim.AdamW(groups, lr=training.lr, betas=(training.adam_beta1, training.adam_beta2),
                             eps=training.adam_epsilon)


def count_parameters(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)

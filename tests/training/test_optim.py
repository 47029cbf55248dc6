"""Freezing and optimizer groups per module group (:mod:`mmtune.training.optim`): the ``frozen``
group (modules image-text training never runs) stays frozen whatever the config trains, and is in
no optimizer group."""

import pytest
from torch import nn

from mmtune.models.base import ModuleGroups
from mmtune.training.config import GroupConfig, TrainingConfig
from mmtune.training.optim import apply_freezing, group_of_parameters, param_groups


def _model_and_groups():
    model = nn.ModuleDict({"vision": nn.Linear(4, 4), "projector": nn.Linear(4, 8), "language_model": nn.Linear(8, 8),
                           "generation_head": nn.Linear(8, 16)})
    groups = ModuleGroups(vision=[model["vision"]], projector=[model["projector"]],
                          language_model=[model["language_model"]], frozen=[model["generation_head"]])
    return model, groups


def test_the_frozen_group_never_trains_and_is_in_no_optimizer_group():
    model, groups = _model_and_groups()
    training = TrainingConfig(vision=GroupConfig(train=True))
    assert group_of_parameters(model, groups)["generation_head.weight"] == "frozen"
    apply_freezing(model, groups, training)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{m}.{p}" for m in ("vision", "projector", "language_model") for p in ("weight", "bias")}
    in_optimizer = {id(p) for group in param_groups(model, groups, training) for p in group["params"]}
    assert not in_optimizer & {id(p) for p in model["generation_head"].parameters()}
    assert {g["name"].split("/")[0] for g in param_groups(model, groups, training)} == {
        "vision", "projector", "language_model"}


def test_a_parameter_outside_every_group_is_named():
    model, groups = _model_and_groups()
    groups.frozen = []
    with pytest.raises(ValueError, match=r"vision/projector/language_model/frozen.*generation_head.weight"):
        group_of_parameters(model, groups)

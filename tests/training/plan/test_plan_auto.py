"""`mmtune plan` on the ``auto`` family's tested classes: parameter counts from the checkpoint's
config on the meta device (no weight read) equal the loaded tiny model's, split into vision
tower, projector and language model as the adapter groups them."""

import pytest

from mmtune.training.plan import plan_run
from mmtune.testing.checkpoints import KINDS
from tests.support.auto_checkpoints import CLASSES, adapter, checkpoint


@pytest.mark.parametrize("kind", CLASSES)
def test_plan_counts_the_parameters_of_the_tiny_checkpoint(kind, env):  # noqa: F811
    p = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b", f"model={kind}_tiny", f"model.path={checkpoint(kind)}"],
                 num_gpus=1, gpu="h100")
    model = adapter(kind).load_model()
    groups = adapter(kind).module_groups(model)
    count = lambda modules: sum({id(p): p.numel() for m in modules for p in m.parameters()}.values())  # noqa: E731 (tied weights once)
    params = p.params
    assert params["total"] == sum(t.numel() for t in model.parameters())
    assert params["vision"] == count(groups.vision) > 0
    assert params["projector"] == count(groups.projector)
    # GLM-4.1V's and the Qwen line's merger sits inside the vision model: the generic grouping counts it there
    assert (params["projector"] > 0) == (not KINDS[kind].projector_in_vision)
    assert params["language_model"] == count(groups.language_model) > 0

"""Project-wide test fixtures."""

import sys

import pytest


@pytest.fixture(autouse=True)
def _fresh_wandb_settings():
    """wandb caches its settings (``WANDB_DIR``, mode) in a process-wide singleton on the
    first ``wandb.init``; tear it down after each test so every test's offline run goes
    to that test's own directory."""
    yield
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is None:
        wandb.teardown()


@pytest.fixture(scope="module")
def adapter():
    """The tiny random-weight LLaVA-1.5 adapter (56 px images, 16 tokens each), one per test module.
    A module that tests another family defines its own ``adapter``."""
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter

    return build_adapter(ModelConfig(family="llava"))

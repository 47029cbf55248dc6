"""Shared fixtures: one small synthetic dataset per session and tiny-run overrides."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    from mmtune.data.synthetic import generate_synthetic

    out = tmp_path_factory.mktemp("synthetic")
    generate_synthetic(out, n_train=32, n_test=4, n_llava=8, seed=0, image_size=56)
    return out


def _tiny_overrides(output_dir, data_dir, *extra: str) -> list[str]:
    """Overrides of the demo experiment for a seconds-long CPU run on ``data_dir``."""
    return [
        "experiment=demo_single_image",
        f"training.output_dir={output_dir}",
        f"synthetic.out_dir={data_dir}",
        f"data.cache_dir={data_dir}/cache",
        "synthetic.n_train=32",
        "synthetic.n_test=4",
        "training.epochs=1",
        "training.eval_before=false",
        "training.eval_after=false",
        "logging.progress_bar=false",
        "collator.batch_size=4",
        *extra,
    ]


@pytest.fixture
def tiny_overrides():
    """``tiny_overrides(output_dir, data_dir, *extra)`` -> Hydra overrides of a tiny run."""
    return _tiny_overrides


@pytest.fixture(autouse=True)
def _reset_accelerate_state():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()

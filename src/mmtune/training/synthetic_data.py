"""The ``synthetic`` section's data: generated into ``synthetic.out_dir`` before a run reads it.

The demos (``mmtune demo``) and the tiny Table 5 runs set ``synthetic.enabled`` (configs/synthetic/);
the recipe calls :func:`generate_synthetic_data` only for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["generate_synthetic_data"]


def generate_synthetic_data(syn: Any, accelerator: Any = None) -> None:
    """Write the synthetic dataset (``synthetic``: ``SyntheticDataConfig``) into ``syn.out_dir`` unless it is
    already there: by the main process, the others waiting (the demos' and the tiny runs' data)."""
    from mmtune.data.synthetic import generate_synthetic

    main_process = accelerator is None or accelerator.is_main_process
    done = all((Path(syn.out_dir) / name).is_file() for name in ("train.json", "test.json", "llava.json"))
    if main_process and not done:
        generate_synthetic(syn.out_dir, n_train=syn.n_train, n_test=syn.n_test, n_llava=syn.n_llava, seed=syn.seed,
                           image_size=syn.image_size, **dict(syn.options))
    if accelerator is not None:
        accelerator.wait_for_everyone()

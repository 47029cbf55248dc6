"""Evaluate a checkpoint (or score prediction files) on the configured benchmarks.

    python recipes/evaluate.py checkpoint=outputs/demo/final eval=synthetic \
        eval.synthetic.data_path=outputs/demo/data/test.json eval.synthetic.image_root=outputs/demo/data/images
    python recipes/evaluate.py checkpoint=runs/llava_mmdu/final eval=mmdu eval.generation.context_length=4096
    # every GPU of the node: each process answers its share of the dialogues, rank 0 scores
    accelerate launch --num_processes 8 recipes/evaluate.py checkpoint=runs/llava_mmdu/final eval=mmdu
    # a served model (vLLM, SGLang, GPT-4o) instead of a checkpoint
    MMTUNE_GEN_BASE_URL=http://127.0.0.1:8000/v1 python recipes/evaluate.py eval=mmdu \
        eval.generation.backend=api eval.generation.api.model=llava-hf/llava-1.5-7b-hf

The config tree is configs/evaluate.yaml, validated against
mmtune.evaluation.config.EvaluateConfig; the work happens in
mmtune.evaluation.runner.evaluate_checkpoint (also what training calls at the end), through
mmtune.evaluation.cli.run_config, which `mmtune evaluate key=value ...` runs too.
"""

import sys

import hydra
from omegaconf import DictConfig

from mmtune.compose import check_recipe_overrides
from mmtune.evaluation.cli import REFUSALS, run_config
from mmtune.evaluation.config import register_configs, to_evaluate_config

register_configs()


@hydra.main(config_path="../configs", config_name="evaluate", version_base=None)
def main(cfg: DictConfig) -> None:
    try:  # an expected refusal is one message, as `mmtune evaluate` prints it, not Hydra's traceback
        run_config(to_evaluate_config(cfg))
    except REFUSALS as err:
        print(f"recipes/evaluate.py: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    # experiment= in either spelling; a typo stops here with one line, not Hydra's exception
    sys.argv[1:] = check_recipe_overrides(sys.argv[1:], "evaluate")
    main()

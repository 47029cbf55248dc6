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
mmtune.evaluation.runner.evaluate_checkpoint (also what training calls at the end).
"""

import hydra
from omegaconf import DictConfig

from mmtune.evaluation.config import default_output_dir, register_configs, to_evaluate_config
from mmtune.evaluation.runner import evaluate_checkpoint

register_configs()


@hydra.main(config_path="../configs", config_name="evaluate", version_base=None)
def main(cfg: DictConfig) -> None:
    config = to_evaluate_config(cfg)
    output_dir = config.output_dir or default_output_dir(config.run_name, config.checkpoint, config.model,
                                                         config.eval.generation)
    results = evaluate_checkpoint(
        config.checkpoint,
        config.eval,
        output_dir=output_dir,
        run_name=config.run_name,
        model_config=config.model,
        wandb=config.wandb,
        wandb_project=config.wandb_project,
    )
    if not results:  # another rank of a data-parallel run: rank 0 scores and reports
        return
    for name, result in results.items():
        headline = {k: round(v, 2) for k, v in result.metrics.items() if "/" not in k}
        print(f"{name}: {headline}")
    print(f"results and report in {output_dir}")


if __name__ == "__main__":
    main()

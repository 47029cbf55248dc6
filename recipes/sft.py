"""Supervised fine-tuning of a vision-language model (a thin Hydra entry point).

    python recipes/sft.py experiment=demo
    accelerate launch --config_file launch/accelerate/single_node_8gpu_zero3.yaml recipes/sft.py \
        model=llava_1_5_7b data=add_to_pool training=mmdu_llava peft=lora_mmdu_llava context=8k

The config tree is configs/sft.yaml, validated against mmtune.training.config.SFTConfig;
the lifecycle (setup -> train -> save -> cleanup) lives in mmtune.training.loop.SFTRecipe.
"""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from mmtune.compose import check_recipe_overrides
from mmtune.training.cli import refusals
from mmtune.training.config import register_configs, to_sft_config
from mmtune.training.loop import SFTRecipe

register_configs()


@hydra.main(config_path="../configs", config_name="sft", version_base=None)
def main(cfg: DictConfig) -> None:
    try:  # an expected refusal is one message, as `mmtune train` prints it, not Hydra's traceback
        config = to_sft_config(cfg)
        recipe = SFTRecipe(config, resolved_config=OmegaConf.to_container(cfg, resolve=True))
        recipe.setup()
        recipe.train()
        recipe.save()
    except refusals() as err:
        print(f"recipes/sft.py: {err}", file=sys.stderr)
        sys.exit(2)
    recipe.cleanup()


if __name__ == "__main__":
    # experiment= in either spelling; a typo stops here with one line, not Hydra's exception
    sys.argv[1:] = check_recipe_overrides(sys.argv[1:], "sft")
    main()

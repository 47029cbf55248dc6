"""Run a tiny SFT job in this process (one rank) and write a digest of its final weights.

Used by test_distributed.py under ``torchrun`` and for single-process DeepSpeed:
``python dist_worker.py OUT_JSON override...``.
"""

import hashlib
import json
import sys

import torch


def main() -> None:
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    out_json, overrides = sys.argv[1], sys.argv[2:]
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    model = recipe.accelerator.unwrap_model(recipe.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()} if not recipe.is_deepspeed else {}
    recipe.train()
    digest = hashlib.sha256()
    changed = 0
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().float().numpy().tobytes())
        if name in before and not torch.equal(before[name], param.detach()):
            changed += 1
    recipe.save()
    recipe.cleanup()
    with open(out_json.format(rank=recipe.accelerator.process_index), "w") as f:
        json.dump({"rank": recipe.accelerator.process_index, "world_size": recipe.accelerator.num_processes,
                   "digest": digest.hexdigest(), "changed": changed, "steps": recipe.step}, f)


if __name__ == "__main__":
    main()

"""One forward/backward of a tiny SFT model under DeepSpeed ZeRO-3 (one CPU process); save loss and gradients.

``python zero3_loss_worker.py OUT.pt override...``: builds the recipe from the demo
experiment plus ``override``s, runs the loop's loss on the first micro-batch and saves
the loss and the full (gathered) gradient of every trainable parameter.
"""

import sys

import torch


def main() -> None:
    from deepspeed.utils import safe_get_full_grad

    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    out, overrides = sys.argv[1], sys.argv[2:]
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    acc = recipe.accelerator
    assert recipe.engine.name == "deepspeed"
    head = recipe.adapter.loss_modules(recipe.model)[1]
    head_status = getattr(head.weight, "ds_status", None)
    batch, _ = next(iter(recipe.data.dataloader(0)))
    summed = recipe.batch_loss(batch)
    acc.backward(summed)
    grads = {}
    for name, param in recipe.model.module.named_parameters():
        if param.requires_grad:
            grad = safe_get_full_grad(param)
            grads[name] = None if grad is None else grad.detach().float().cpu().clone()
    torch.save({"loss": float(summed.detach()), "grads": grads, "head_status": getattr(head_status, "name", None),
                "description": recipe.loss.description}, out)
    recipe.cleanup()


if __name__ == "__main__":
    main()

"""Run a tiny SFT job in this process (one rank) and write a digest of its final weights.

Used by test_distributed.py under ``torchrun`` and for single-process DeepSpeed:
``python dist_worker.py OUT_JSON override...``. With ``GRADS_OUT`` set, the gradient of
the first optimizer step (after the all-reduce) is saved to ``GRADS_OUT.format(rank=...)``.
"""

import hashlib
import json
import os
import sys

import torch


def main() -> None:
    from mmtune.training.config import to_sft_config
    from mmtune.training.demo import compose_sft_config
    from mmtune.training.loop import SFTRecipe

    out_json, overrides = sys.argv[1], sys.argv[2:]
    recipe = SFTRecipe(to_sft_config(compose_sft_config(overrides)))
    recipe.setup()
    model = recipe.engine.unwrap(recipe.model)
    # Under ZeRO-3 a parameter is an empty shard here: nothing to compare.
    before = {n: p.detach().clone() for n, p in model.named_parameters()} if recipe.engine.name != "deepspeed" else {}
    micro_batches = []
    batches = recipe._micro_batches
    recipe._micro_batches = lambda: (micro_batches.append(item[1]) or item for item in batches())
    grads_out = os.environ.get("GRADS_OUT")
    if grads_out:
        inner = getattr(recipe.optimizer, "optimizer", recipe.optimizer)  # FSDP2 leaves it unwrapped
        inner_step = inner.step

        def save_first_gradient(*args, **kwargs):
            path = grads_out.format(rank=recipe.accelerator.process_index)
            if not os.path.exists(path):
                # An FSDP2 gradient is this rank's shard: every rank gathers the whole one (a collective).
                grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                         for n, p in model.named_parameters() if p.grad is not None}
                torch.save(grads, path)
            return inner_step(*args, **kwargs)

        inner.step = save_first_gradient
    recipe.train()
    digest = hashlib.sha256()
    changed = 0
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # an FSDP2 shard: the whole weight
        digest.update(full.detach().cpu().float().numpy().tobytes())
        if name in before and not torch.equal(before[name], param.detach()):  # own shards compared under FSDP2
            changed += 1
    recipe.save()
    recipe.cleanup()
    with open(out_json.format(rank=recipe.accelerator.process_index), "w") as f:
        json.dump({"rank": recipe.accelerator.process_index, "world_size": recipe.accelerator.num_processes,
                   "digest": digest.hexdigest(), "changed": changed, "steps": recipe.step,
                   "micro_batches": len(micro_batches),
                   "fillers": sum(bool(m.get("filler")) for m in micro_batches)}, f)


if __name__ == "__main__":
    main()

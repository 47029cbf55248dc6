"""One rank of the sequence-parallel equality check: ``torchrun --nproc_per_node N sp_worker.py OUT FAMILY IMAGES``.

Every rank builds the same tiny model and rows, runs each row once whole (the one-process
reference: the model's own sdpa attention, the chunked loss) and once as its shard under
:class:`SequenceParallel`, sums the shard losses and gradients over the group and writes,
per case, the largest absolute differences to ``OUT`` (one JSON file per rank,
``{rank}`` in ``OUT``). For Qwen2-VL it also compares each shard's M-RoPE positions with
the slice of the whole row's ``get_rope_index`` (per packed sample, restarted).
"""

import json
import sys
from dataclasses import replace

import torch
import torch.distributed as dist


def main() -> None:
    from mmtune.data.collator import MultiImageCollator, forward_inputs
    from mmtune.data.dialogue import Dialogue, Image, Turn
    from mmtune.data.encoding import Example, encode_example
    from mmtune.data.images import ImagePipeline
    from mmtune.models.base import IGNORE_INDEX
    from mmtune.models.config import ModelConfig
    from mmtune.models.registry import build_adapter
    from mmtune.training.loss import TrainingLoss
    from mmtune.training.sequence_parallel import SequenceParallel
    from mmtune.training.sequence_parallel.shard import padded_length, shard_bounds

    out_path, family, image_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    adapter = build_adapter(ModelConfig(family=family))
    model = adapter.load_model(seed=0, attn_implementation="sdpa").train()
    loss = TrainingLoss(adapter, model, impl="chunked", chunk_size=64)
    sp = SequenceParallel.create(dist.get_world_size(), adapter, model, attn_implementation="sdpa")
    paths = [f"{image_dir}/{k}.png" for k in range(4)]
    pipe = ImagePipeline(adapter)

    def example(d: Dialogue) -> Example:
        return encode_example(adapter, d, max_length=1 << 15)  # the collators load the images

    def talk(i: int, *segments) -> Dialogue:
        turns = []
        for k, user in enumerate(segments):
            turns += [Turn("user", user), Turn("assistant", (f"answer {k} of dialogue {i}, with some words",))]
        return Dialogue(f"d{i}", "t", tuple(turns))

    long_dialogue = talk(0, ("Look: ", Image(paths[0]), " and tell me"), ("Now this one ", Image(paths[1])),
                         ("A question with no image, a bit longer than the others",),
                         ("Both again ", Image(paths[2]), Image(paths[3]), " compare them"))
    packed = [talk(1, ("Hi", Image(paths[0]))), talk(2, ("Just text here",)),
              talk(3, ("Two: ", Image(paths[1]), Image(paths[2]))), talk(4, ("short",))]
    text_only = [talk(5, ("Only text",), ("and more text in a second turn",)), talk(6, ("text again",))]
    collate = MultiImageCollator(adapter.tokenizer.pad_token_id, image_pipeline=pipe)
    collate_packed = MultiImageCollator(adapter.tokenizer.pad_token_id, image_pipeline=pipe, packed=True)

    def packed_row(dialogues, extra_token=False):
        examples = [example(d) for d in dialogues]
        if extra_token:  # a 1-token sample: makes the row length odd
            examples.append(Example("one-token", [examples[0].input_ids[0]], [IGNORE_INDEX]))
        return collate_packed([replace(e, row=0) for e in examples]), examples

    image_token = model.config.image_token_id
    size = dist.get_world_size()

    def across_boundary(batch) -> bool:
        """Whether an image's token run crosses the boundary between the first two shards."""
        length = batch["input_ids"].shape[1]
        half = padded_length(length, size) // size
        ids = batch["input_ids"][0]
        return bool(half < length and ids[half - 1] == image_token and ids[half] == image_token)

    def straddling(uneven: bool):
        """The packed dialogues with the text-only one lengthened (and a 1-token sample added or
        not) until an image crosses the shard boundary, in a row whose length divides by N or not."""
        for words in range(200):
            dialogues = [talk(2, ("Just text here" + " word" * words,)), packed[2], packed[0], packed[3]]
            for extra_token in (False, True):
                row, examples = packed_row(dialogues, extra_token)
                if across_boundary(row) and bool(row["input_ids"].shape[1] % size) == uneven:
                    return row, examples
        raise AssertionError("no length of the text dialogue puts an image across the shard boundary")

    cases = {}
    cases["single long dialogue"] = (collate([example(long_dialogue)]), [example(long_dialogue)])
    cases["packed row, image across the shard boundary"] = straddling(False)
    cases["text-only packed row"] = packed_row(text_only)
    cases["length not divisible by N (padded)"] = straddling(True)
    # two rows of one batch, padding mode: the shorter one right-padded
    cases["two padded rows"] = (collate([example(long_dialogue), example(packed[2])]), None)

    results = {}
    for name, (batch, examples) in cases.items():
        inputs = forward_inputs(batch)
        length = batch["input_ids"].shape[1]
        total = padded_length(length, sp.size)
        start, stop = shard_bounds(total, sp.size, sp.groups.rank)
        # whole row, one process
        model.zero_grad(set_to_none=True)
        ref = loss(model, inputs, batch["labels"])
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        # sharded
        model.zero_grad(set_to_none=True)
        seen = {}

        def record(_m, args, kwargs):
            seen["positions"] = kwargs["position_ids"].clone()
            seen["length"] = kwargs["inputs_embeds"].shape[1]

        encoded = []
        vision = adapter.module_groups(model).vision[0]
        count = vision.register_forward_pre_hook(lambda m, a, k: encoded.append(
            int((a[0] if a else k.get("pixel_values", k.get("hidden_states"))).shape[0])), with_kwargs=True)
        with sp.step(model, inputs, batch["labels"]) as targets:
            tap = sp.lm.register_forward_pre_hook(record, with_kwargs=True)
            mine = loss(model, inputs, targets, shifted=True)
            tap.remove()
        mine.backward()
        count.remove()
        summed = mine.detach().clone()
        dist.all_reduce(summed)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        for g in grads.values():
            dist.all_reduce(g)
        missing = sorted(set(ref_grads) ^ set(grads))
        diff = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads if n in grads)
        scale = max(float(g.abs().max()) for g in ref_grads.values())
        image_rows = inputs.get(adapter.image_input_names[0])
        result = {
            "length": length, "shard_length": seen["length"], "loss": float(ref), "loss_sp": float(summed),
            "loss_diff": abs(float(ref) - float(summed)), "grad_max_abs_diff": diff, "grad_max_abs": scale,
            "grads": len(ref_grads), "missing_grads": missing,
            "encoded_rows": sum(encoded), "image_rows": 0 if image_rows is None else int(image_rows.shape[0]),
            "loss_tokens": int(batch["num_loss_tokens"]),
        }
        result["image_across_boundary"] = across_boundary(batch)
        ids = batch["input_ids"][0]
        if adapter.position_id_rows == 3 and examples is not None:
            whole = []
            offset = 0
            for e in examples:
                n = len(e.input_ids)
                sample_ids = ids[offset:offset + n][None]
                grid = collate._image_inputs(e)["image_grid_thw"] if e.images else None
                pos, _ = model.model.get_rope_index(sample_ids, (sample_ids == image_token).int(), image_grid_thw=grid)
                whole.append(pos[:, 0])
                offset += n
            whole = torch.cat(whole, dim=1)
            tail = torch.arange(total - whole.shape[1]).expand(3, -1)
            whole = torch.cat([whole, tail], dim=1)
            result["mrope_shard_equals_slice"] = bool(torch.equal(seen["positions"][1:, 0], whole[:, start:stop]))
        results[name] = result
    with open(out_path.format(rank=rank), "w") as f:
        json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

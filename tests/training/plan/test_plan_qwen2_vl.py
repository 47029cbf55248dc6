"""`mmtune plan` on the qwen2_vl family: the Qwen2.5-VL-7B experiment sized from the published
architecture (no download, no weights read), with the merger counted as the projector."""

import pytest

from mmtune.training.plan import PlanError, main, plan_run
from mmtune.training.plan.common import human


def test_plan_sizes_the_qwen2_5_vl_7b_experiment(env, capsys):
    p = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b"], num_gpus=8, gpu="h100",
                 accelerate_config="launch/accelerate/single_node_8gpu_zero3.yaml")
    assert p.run_name == "mmdu45k_qwen2_5_vl_7b"
    params = p.params
    assert params["source"] == "published architecture of Qwen/Qwen2.5-VL-7B-Instruct"
    assert 8.2e9 < params["total"] < 8.35e9  # Qwen2.5-VL-7B: 8.29B
    assert 30e6 < params["projector"] < 60e6 and params["vision"] > 10 * params["projector"]  # merger vs tower
    assert params["trainable"] == params["projector"] + params["language_model"]  # vision frozen, full FT
    assert params["image_tokens"] == 64  # max_pixels 50176 / 28^2
    assert p.engine["settings"]["stage"] == 3 and p.peft["method"] == "none"
    assert p.data["samples_per_epoch"] > 0 and p.cost["optimizer_steps"] >= 1
    assert "packing 1 row(s) of 8192 tokens" in p.render()
    assert main(["experiment=mmdu45k_qwen2_5_vl_7b"]) == 0
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in capsys.readouterr().out


def test_plan_sizes_qwen3_vl_8b_and_the_tiny_model(env):
    p = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b", "model=qwen3_vl_8b"], num_gpus=8, gpu="h100")
    assert 8.7e9 < p.params["total"] < 8.85e9 and p.params["image_tokens"] == 49  # 50176 / 32^2
    tiny = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b", "model=qwen2_vl_tiny"], num_gpus=1, gpu="h100")
    assert tiny.params["total"] < 1e6 and tiny.params["projector"] > 0


def test_plan_of_the_32k_experiment_splits_each_row_over_4_gpus(env):
    """The 32k experiment on its own launcher (8 plain processes, fsdp2): 2 data-parallel groups of 4,
    a GPU holding a quarter of each 32k row, and a longest row above the configured 32k."""
    p = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b_32k"], num_gpus=None, gpu="h100")
    one = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b_32k", "training.sequence_parallel.size=1"], num_gpus=None,
                   gpu="h100")
    assert p.engine["name"] == "fsdp2" and p.engine["num_gpus"] == 8 and "single_node_8gpu_fsdp2" in p.engine["origin"]
    accum = 4  # the 8k experiment's, inherited
    assert p.batching["per_step"] == 2 * accum and one.batching["per_step"] == 8 * accum
    assert "x 4 accumulation x 2 data-parallel group(s) of 4 GPUs (sequence parallel) = 8 micro-batches" \
        in p.batching["description"]
    micro = p.batching["micro_batches_per_epoch"]
    assert p.cost["optimizer_steps"] == -(-micro // 8) and one.cost["optimizer_steps"] == -(-micro // 32)
    cost, alone = p.cost, one.cost
    assert cost["sequence_parallel"] == 4 and cost["fits"]
    assert cost["memory_gib"]["activations"] < alone["memory_gib"]["activations"] / 2
    # by memory, SP=4 lengthens the longest row over 3x; both pass the model's 128000 positions, which bound it
    assert 32768 < alone["longest_row_tokens"] and cost["longest_row_tokens"] > 3 * alone["longest_row_tokens"]
    assert p.context["original"] == 128000 and cost["longest_row_tokens"] > 128000
    assert (f"longest row ~{human(128000)} tokens: the model's 128000-position window (memory alone would fit "
            f"~{human(cost['longest_row_tokens'])} tokens a GPU with sequence parallelism over 4 GPUs per row)") \
        in p.render()
    # on a 24 GB GPU memory is the bound, below the window
    small = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b_32k"], num_gpus=None, gpu="a10g")
    assert 0 < small.cost["longest_row_tokens"] < 128000
    assert f"longest row ~{human(small.cost['longest_row_tokens'])} tokens fit a GPU with sequence parallelism " \
           "over 4" in small.render()
    with pytest.raises(PlanError, match="training.sequence_parallel.size=4 does not divide the 6 launched ranks"):
        plan_run(["experiment=mmdu45k_qwen2_5_vl_7b_32k"], num_gpus=6, gpu="h100")

"""`mmtune plan` on the qwen2_vl family: the Qwen2.5-VL-7B experiment sized from the published
architecture (no download, no weights read), with the merger counted as the projector."""

from mmtune.training.plan import main, plan_run


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
    assert p.zero["stage"] == 3 and p.peft["method"] == "none"
    assert p.data["samples_per_epoch"] > 0 and p.cost["optimizer_steps"] >= 1
    assert "packing 1 row(s) of 8192 tokens" in p.render()
    assert main(["experiment=mmdu45k_qwen2_5_vl_7b"]) == 0
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in capsys.readouterr().out


def test_plan_sizes_qwen3_vl_8b_and_the_tiny_model(env):
    p = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b", "model=qwen3_vl_8b"], num_gpus=8, gpu="h100")
    assert 8.7e9 < p.params["total"] < 8.85e9 and p.params["image_tokens"] == 49  # 50176 / 32^2
    tiny = plan_run(["experiment=mmdu45k_qwen2_5_vl_7b", "model=qwen2_vl_tiny"], num_gpus=1, gpu="h100")
    assert tiny.params["total"] < 1e6 and tiny.params["projector"] > 0

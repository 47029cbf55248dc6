"""Sequence parallelism on 2 gloo ranks equals one process: the loss and every gradient of a
single long dialogue, a packed row with an image across the shard boundary, a text-only row,
a row whose length does not divide by 2, and two right-padded rows; each image encoded once
across the group; Qwen2-VL's M-RoPE positions on each shard equal the slice of the whole
row's ``get_rope_index``. Plus the start-up checks, on one process."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image as PILImage

from mmtune.training.sequence_parallel import setup_problems

WORKER = Path(__file__).with_name("sp_worker.py")
CASES = ["single long dialogue", "packed row, image across the shard boundary", "text-only packed row",
         "length not divisible by N (padded)", "two padded rows"]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp_images")
    for k, colour in enumerate([(255, 0, 0), (0, 200, 0), (0, 0, 255), (200, 200, 0)]):
        PILImage.new("RGB", (40 + 12 * k, 48), colour).save(root / f"{k}.png")
    return root


def _run(family, image_dir, tmp_path):
    from tests.support.processes import free_port

    out = str(tmp_path / "rank{rank}.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(WORKER), out, family, str(image_dir)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(Path(out.format(rank=r)).read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_two_ranks_equal_one_process(family, image_dir, tmp_path):
    ranks = _run(family, image_dir, tmp_path)
    assert list(ranks[0]) == CASES
    for case in CASES:
        r0, r1 = ranks[0][case], ranks[1][case]
        # the group's summed loss per loss token (the logged loss) equals one process's
        assert r0["loss_diff"] / r0["loss_tokens"] <= 1e-5, case
        assert r0["loss_sp"] == r1["loss_sp"], case
        # every gradient, summed over the group: within 1e-5 of one process relative to the largest
        assert not r0["missing_grads"] and r0["grads"] > 0, case
        assert r0["grad_max_abs_diff"] <= 1e-5 * max(1.0, r0["grad_max_abs"]), case
        assert r0["shard_length"] == -(-r0["length"] // 2), case
        # each image encoded once across the group, and both ranks did some of the work
        assert r0["encoded_rows"] + r1["encoded_rows"] == r0["image_rows"], case
        if r0["image_rows"] > 1:
            assert r0["encoded_rows"] and r1["encoded_rows"], case
        if family == "qwen2_vl" and case != "two padded rows":
            assert r0["mrope_shard_equals_slice"] and r1["mrope_shard_equals_slice"], case
    assert ranks[0][CASES[1]]["image_across_boundary"] and ranks[0][CASES[3]]["image_across_boundary"]
    assert ranks[0][CASES[3]]["length"] % 2 == 1


def test_setup_problems_are_collected_with_the_numbers():
    text = SimpleNamespace(num_attention_heads=6, num_key_value_heads=3)
    problems = setup_problems(4, world_size=6, text_config=text, attn_implementation="flash_attention_2")
    joined = "\n".join(problems)
    assert "size=4 does not divide the 6 launched ranks" in joined
    assert "6 attention heads do not divide by training.sequence_parallel.size=4" in joined
    assert "3 key/value heads" in joined
    assert "model.attn_implementation=flash_attention_2 cannot be split" in joined
    assert setup_problems(2, world_size=4, text_config=SimpleNamespace(num_attention_heads=4, num_key_value_heads=2),
                          attn_implementation="sdpa") == []
    assert setup_problems(1, world_size=3, text_config=text, attn_implementation="eager") == []

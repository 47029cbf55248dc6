"""Fixtures of the ``mmtune plan`` tests: a stand-in data and checkpoint tree under the roots
the shipped configs name ($MMTUNE_DATA_ROOT, $MMTUNE_CKPT_ROOT, $MMTUNE_OUTPUT_ROOT).

The stand-in tree mirrors the real layout (MMDU-45k, llava-665k, MMDU benchmark, MM-Vet)
with the synthetic generator's files, and stand-in checkpoint directories hold only a
config.json: plan never reads weights.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from mmtune.models.internlm_xcomposer2 import InternLMXComposer2Adapter
from mmtune.models.llava import LlavaAdapter

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> Path:
    from mmtune.data.synthetic import generate_synthetic
    from mmtune.models import internlm_xcomposer2 as xc2
    from transformers import AutoConfig

    root = tmp_path_factory.mktemp("standin")
    syn = generate_synthetic(root / "synthetic", n_train=12, n_test=4, n_llava=12, image_size=16)
    data = root / "data"
    (data / "mmdu").mkdir(parents=True)
    (data / "llava").mkdir()
    links = {
        data / "mmdu" / "mmdu-45k.json": syn.train_json,
        data / "mmdu" / "mmdu-45k_pics": syn.image_dir,
        data / "mmdu" / "benchmark.json": syn.test_json,
        data / "mmdu" / "mmdu_pics": os.path.join(syn.image_dir, "mmdu_pics"),
        data / "llava" / "llava_v1_5_mix665k.json": syn.llava_json,
        data / "llava" / "synthetic": os.path.join(syn.image_dir, "synthetic"),
    }
    for link, target in links.items():
        if os.path.isdir(target):  # image folders: real copies (a symlink out of the image root is refused)
            shutil.copytree(target, link)
        else:
            link.symlink_to(target)
    mmvet = data / "mm-vet"
    (mmvet / "images").mkdir(parents=True)
    items = {}
    for i, png in enumerate(sorted(Path(syn.image_dir, "mmdu_pics").glob("*.png"))[:3]):
        shutil.copy(png, mmvet / "images" / png.name)
        items[f"v1_{i}"] = {"imagename": png.name, "question": "What color?", "answer": "red", "capability": ["rec"]}
    (mmvet / "mm-vet.json").write_text(json.dumps(items))

    # Checkpoints: only config.json (the stage-1 LLaVA for "add to the pool", and the
    # final/ directories the *_eval rows evaluate).
    llava = AutoConfig.for_model(**LlavaAdapter.known_architectures["llava-hf/llava-1.5-7b-hf"])
    stage1 = root / "ckpt" / "llava-v1.5-7b-pretrain-hf"
    stage1.mkdir(parents=True)
    llava.to_json_file(str(stage1 / "config.json"))
    xc2_config = xc2.native_config_from_official(InternLMXComposer2Adapter.known_architectures["internlm/internlm-xcomposer2-vl-7b"],
                                                 image_size=490, plora_r=256)
    for run in ("table3_llava15_7b_mmdu45k", "table5_mmdu45k_8k", "table5_sft_continue", "table5_sft_pool",
                "table3_xc2_mmdu45k"):
        final = root / "outputs" / run / "final"
        final.mkdir(parents=True)
        (xc2_config if "xc2" in run else llava).to_json_file(str(final / "config.json"))
    return root


@pytest.fixture
def env(standin: Path, monkeypatch):
    monkeypatch.setenv("MMTUNE_DATA_ROOT", str(standin / "data"))
    monkeypatch.setenv("MMTUNE_CKPT_ROOT", str(standin / "ckpt"))
    monkeypatch.setenv("MMTUNE_OUTPUT_ROOT", str(standin / "outputs"))
    monkeypatch.setenv("MMTUNE_CACHE_DIR", str(standin / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)
    return standin

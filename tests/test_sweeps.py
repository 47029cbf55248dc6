"""Sweep files and the slurm launcher: every sweep grid point composes into a valid run
config with the real config tree (no W&B contact), and the slurm script hands slurm's
variables to `accelerate launch` correctly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from mmtune.evaluation.config import to_evaluate_config
from mmtune.training.config import to_sft_config
from mmtune.training.plan import compose_run, sweep_accelerate_config, sweep_grid, sweep_recipe

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted((REPO / "launch" / "sweeps").glob("*.yaml"))


def _points():
    for sweep in SWEEPS:
        for point in sweep_grid(yaml.safe_load(sweep.read_text())):
            yield pytest.param(sweep, point, id=f"{sweep.stem}:{' '.join(point)}")


def test_sweep_files_exist():
    assert {p.name for p in SWEEPS} >= {"table3.yaml", "table5.yaml"}


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda p: p.name)
def test_sweep_file_shape(sweep: Path):
    spec = yaml.safe_load(sweep.read_text())
    first = sweep.read_text().splitlines()[0]
    assert first.startswith("#") and "wandb sweep" in sweep.read_text(), "a sweep file starts with how to run it"
    assert spec["method"] == "grid"
    command = spec["command"]
    assert command[0] == "${env}" and command[-1] == "${args_no_hyphens}"
    assert "${program}" in command
    assert (REPO / spec["program"]).is_file(), f"program {spec['program']} does not exist"
    if sweep_recipe(sweep) == "sft":
        assert command[1:3] == ["accelerate", "launch"], "training sweeps run under accelerate"
    if "--config_file" in command:
        config = command[command.index("--config_file") + 1]
        assert (REPO / config).is_file(), f"{sweep.name}: accelerate config {config} does not exist"
    key = "experiment" if sweep_recipe(sweep) == "sft" else "+experiment"
    values = spec["parameters"][key]["values"]
    assert len(values) == len(set(values)) >= 2
    for name in values:
        assert (REPO / "configs" / "experiment" / f"{name}.yaml").is_file(), f"{sweep.name}: no experiment {name}"


@pytest.mark.parametrize("sweep,point", list(_points()))
def test_grid_point_composes(sweep: Path, point: list[str], monkeypatch, tmp_path):
    # Interpolations such as ${oc.env:MMTUNE_DATA_ROOT,data} resolve without real data.
    monkeypatch.setenv("MMTUNE_DATA_ROOT", str(tmp_path))
    monkeypatch.chdir(REPO)
    recipe = sweep_recipe(sweep)
    cfg = compose_run(point, config_name=recipe)
    run = to_sft_config(cfg) if recipe == "sft" else to_evaluate_config(cfg)
    experiment = point[0].split("=", 1)[1]
    assert run.run_name == experiment, "a row's run is named after its experiment (the report matches on it)"
    # the sweep runs each row with the recipe and the launcher the row's typed keys declare
    assert run.recipe.value == recipe, f"{experiment} has recipe: {run.recipe.value}, the sweep runs {recipe}"
    assert run.launcher == sweep_accelerate_config(sweep)
    if recipe == "evaluate":
        # evaluation rows name the benchmark data, and the trained ones the checkpoint they evaluate
        assert run.eval.benchmarks and "mmdu" in run.eval.benchmarks
        assert run.eval.mmdu.data_path.startswith(str(tmp_path))


def test_sweep_grid_crosses_values_and_keeps_fixed():
    spec = {"method": "grid", "parameters": {"experiment": {"values": ["a", "b"]},
                                             "training.lr": {"values": [1e-4, 2e-4]},
                                             "logging.wandb": {"value": True}}}
    points = sweep_grid(spec)
    assert len(points) == 4
    assert points[0] == ["experiment=a", "training.lr=0.0001", "logging.wandb=true"]
    with pytest.raises(ValueError, match="grid"):
        sweep_grid({"method": "bayes", "parameters": {"experiment": {"values": ["a"]}}})


# ----------------------------------------------------------------------------- slurm


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "accelerate").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$FAKE_OUT"\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nprintf "gpu-node-07\\ngpu-node-08\\ngpu-node-09\\n"\n')
    # srun: run the per-node script once per node, as slurm would, with that node's id.
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
        'for ((i=0; i<SLURM_NNODES; i++)); do FAKE_OUT="$FAKE_OUT.$i" SLURM_NODEID=$i SLURM_PROCID=$i "$@" || exit $?; done\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def test_slurm_script_launches_accelerate_on_every_node(tmp_path: Path):
    env = dict(os.environ, PATH=f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", FAKE_OUT=str(tmp_path / "argv"),
               SLURM_NNODES="3", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="gpu-node-[07-09]",
               SLURM_GPUS_ON_NODE="8", SLURM_SUBMIT_DIR=str(REPO))
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/sft.sbatch"), "experiment=table5_mmdu45k_8k"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for node in range(3):
        argv = (tmp_path / f"argv.{node}").read_text().split("\n")[:-1]
        assert argv[0] == "launch"
        opts = dict(zip(argv[1:-2:2], argv[2:-2:2]))
        assert opts["--num_machines"] == "3" and opts["--machine_rank"] == str(node)
        assert opts["--num_processes"] == "24"
        assert opts["--main_process_ip"] == "gpu-node-07"
        assert opts["--main_process_port"] == str(20000 + 4242 % 20000)
        assert (REPO / opts["--config_file"]).is_file(), opts["--config_file"]
        assert argv[-2:] == ["recipes/sft.py", "experiment=table5_mmdu45k_8k"]


def test_slurm_extra_accelerate_args_and_recipe(tmp_path: Path):
    env = dict(os.environ, PATH=f"{_fake_bin(tmp_path)}:{os.environ['PATH']}", FAKE_OUT=str(tmp_path / "argv"),
               SLURM_NNODES="1", SLURM_JOB_ID="7", SLURM_JOB_NODELIST="n1", SLURM_SUBMIT_DIR=str(REPO),
               ACCELERATE_EXTRA_ARGS="--deepspeed_config_file launch/deepspeed/zero2.json", GPUS_PER_NODE="4",
               RECIPE="recipes/evaluate.py")
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/sft.sbatch"), "+experiment=table5_baseline_2k"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv.0").read_text().split("\n")[:-1]
    assert argv[-4:] == ["--deepspeed_config_file", "launch/deepspeed/zero2.json", "recipes/evaluate.py",
                         "+experiment=table5_baseline_2k"]
    assert argv[argv.index("--num_processes") + 1] == "4"


def test_slurm_script_refuses_without_experiment(tmp_path: Path):
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/sft.sbatch")], capture_output=True, text=True,
                          timeout=30, cwd=tmp_path, env=dict(os.environ, SLURM_SUBMIT_DIR=str(REPO)))
    assert proc.returncode == 2 and "experiment=" in proc.stderr


def test_node_launcher_needs_slurm(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(REPO / "launch/slurm/node_launch.sh"), "experiment=x"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "SLURM_NNODES" in proc.stderr


def test_the_old_launcher_lookup_reads_the_typed_key_and_says_it_is_deprecated():
    from mmtune.training.plan.sweeps import experiment_launcher

    with pytest.deprecated_call():
        assert experiment_launcher(["experiment=table5_sft_pool"]) == "launch/accelerate/single_node_8gpu_zero3.yaml"
    with pytest.deprecated_call():
        assert experiment_launcher(["training.lr=1e-4"]) is None

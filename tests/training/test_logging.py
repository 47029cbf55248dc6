"""Secret redaction, MFU, and W&B offline logging of the resolved config."""

import json

import pytest

from mmtune.training.config import LoggingConfig
from mmtune.training.logging import RunLogger, cut_jsonl_after, mfu, peak_flops, redact


def test_redact_hides_secret_strings_only():
    config = {"judge": {"api_key": "sk-123", "api_key_env": "MMTUNE_JUDGE_API_KEY", "max_tokens": 2048,
                        "cache_key": "3f2a9c", "cache_dir": "/tmp/judge"},
              "hub_token": "hf_abc", "db_password": "pw", "client_secret": "s", "lr": 1e-4, "HF_TOKEN": "hf_x",
              "token": "t0", "openaiApiKey": "sk-2",
              "model": {"tokenizer": "lmsys/vicuna-7b", "pad_token": "<pad>", "image_token": "<image>",
                        "token_file": "~/.cache/token"},
              "sources": [{"name": "x", "auth_token": "t", "key": "mmdu-45k"}]}
    out = redact(config)
    assert out["judge"]["api_key"] == out["hub_token"] == out["db_password"] == out["client_secret"] == "***"
    assert out["HF_TOKEN"] == out["token"] == out["openaiApiKey"] == out["sources"][0]["auth_token"] == "***"
    assert out["judge"]["max_tokens"] == 2048 and out["lr"] == 1e-4 and out["sources"][0]["name"] == "x"
    # Names of variables that hold secrets, cache keys, special tokens and paths are not secrets.
    assert out["judge"]["api_key_env"] == "MMTUNE_JUDGE_API_KEY" and out["judge"]["cache_key"] == "3f2a9c"
    assert out["model"] == config["model"] and out["sources"][0]["key"] == "mmdu-45k"


def test_cut_jsonl_after_keeps_rows_up_to_the_step(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in range(1, 6))
                   + '{"step": 6, "train/lo')  # torn by a kill
    assert cut_jsonl_after(log, 3) == 3
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]
    assert cut_jsonl_after(log, 3) == 0 and cut_jsonl_after(tmp_path / "absent.jsonl", 3) == 0


def test_mfu_uses_peak_of_the_device():
    assert peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12)
    assert mfu(7_000_000_000, 3000.0, "NVIDIA A100-SXM4-80GB") == pytest.approx(6 * 7e9 * 3000 / 312e12)
    assert mfu(7_000_000_000, 3000.0, "NVIDIA A100-SXM4-80GB", num_devices=8) == pytest.approx(6 * 7e9 * 3000 / 312e12 / 8)
    assert mfu(1000, 10.0, "cpu") is None


def test_wandb_offline_run_gets_redacted_config_and_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(wandb=True, project="mmtune-test", tags=["unit"], progress_bar=False)
    logger = RunLogger(cfg, output_dir=str(tmp_path), is_main=True, total_steps=2,
                       resolved_config={"training": {"lr": 0.1}, "judge": {"api_key": "sk-SECRET"}})
    calls = []
    log_to_wandb = logger.wandb_run.log
    logger.wandb_run.log = lambda data, step=None: calls.append((step, dict(data))) or log_to_wandb(data, step=step)
    logger.log(1, {"train/loss": 1.5, "train/lr": 0.1})
    # What W&B holds, read through its public Run API: the redacted config; and the
    # metrics as handed to Run.log.
    sent = dict(logger.wandb_run.config)
    assert sent["judge"] == {"api_key": "***"} and sent["training"] == {"lr": 0.1}
    assert calls == [(1, {"train/loss": 1.5, "train/lr": 0.1})]
    logger.close()
    every_file = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert b"sk-SECRET" not in every_file  # nothing on disk holds the secret
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [{"step": 1, "train/loss": 1.5, "train/lr": 0.1}]


class _FullDisk:
    """A file whose write gets half a line out, then fails as a full disk does."""

    def __init__(self, opener, path, mode):
        self.file = opener(path, mode)

    def write(self, text):
        import errno

        self.file.write(text[: len(text) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_while_logging_names_metrics_jsonl_and_the_last_checkpoint(tmp_path, monkeypatch):
    from mmtune.io.disk import DiskFullError
    from mmtune.training.checkpoint import TRAINER_STATE

    (tmp_path / "checkpoints" / "step-4").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-4" / TRAINER_STATE).write_text(json.dumps({"step": 4}))
    logger = RunLogger(LoggingConfig(progress_bar=False), output_dir=str(tmp_path), resolved_config={},
                       is_main=True, total_steps=8)
    logger.log(5, {"train/loss": 1.0, "train/lr": 1e-3})
    from mmtune.training import logging as run_logging

    real_open = run_logging.open_output  # every writer into the run folder opens through it (io/nofollow.py)
    def full_for_metrics(path, mode="w", *args, **kwargs):
        if str(path).endswith("metrics.jsonl"):
            return _FullDisk(real_open, path, mode)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_logging, "open_output", full_for_metrics)
    with pytest.raises(DiskFullError) as info:
        logger.log(6, {"train/loss": 0.9, "train/lr": 1e-3})
    monkeypatch.undo()
    message = str(info.value)
    assert f"no space left on the device holding {tmp_path / 'metrics.jsonl'} while writing metrics.jsonl" in message
    assert f"{tmp_path / 'checkpoints' / 'step-4'} (step 4), is intact" in message
    # The torn line goes when a resume cuts the log back to the checkpoint.
    assert cut_jsonl_after(tmp_path / "metrics.jsonl", 4) == 2
    assert (tmp_path / "metrics.jsonl").read_text() == ""

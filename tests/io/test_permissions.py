"""Files written by safetensors get the umask's mode, as files written with open() do."""

import os

import pytest
import torch
from safetensors.torch import save_file

from mmtune.io.permissions import current_umask, default_file_mode, restore_default_modes


@pytest.fixture
def umask():
    """Set the process umask for one test and put the old one back."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077, 0o002])
def test_current_umask_reads_the_mask_without_changing_it(umask, mask):
    umask(mask)
    assert current_umask() == mask
    assert current_umask() == mask  # reading it twice: still the same
    assert default_file_mode() == 0o666 & ~mask


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_safetensors_files_end_with_the_mode_of_their_json_neighbours(tmp_path, umask, mask):
    umask(mask)
    (tmp_path / "sub").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "sub" / "adapter_model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    json_mode = (tmp_path / "config.json").stat().st_mode & 0o777
    changed = restore_default_modes(tmp_path)
    for path in (tmp_path / "model.safetensors", tmp_path / "sub" / "adapter_model.safetensors"):
        assert path.stat().st_mode & 0o777 == json_mode == 0o666 & ~mask
    # safetensors writes 0600 whatever the umask, so every file was changed unless the
    # umask itself asks for 0600
    assert len(changed) == 2
    assert restore_default_modes(tmp_path) == []  # nothing left to change

"""The resume policy's parts on their own (training/resume.py); whole resumes: test_resume.py, test_loop.py."""

import pytest
from accelerate import PartialState

from mmtune.training.checkpoint import OutputDirInUseError
from mmtune.training.layout import RankLayout
from mmtune.training.resume import choose_checkpoint, random_state_note, refuse_used_output_dir, reset_step_logs


def test_a_folder_with_checkpoints_is_not_trained_into_afresh(tmp_path):
    state = PartialState(cpu=True)
    refuse_used_output_dir(state, tmp_path, None, overwrite=False)  # empty: fine
    step = tmp_path / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 2}')
    with pytest.raises(OutputDirInUseError, match="holds an earlier run .*training.resume=auto"):
        refuse_used_output_dir(state, tmp_path, None, overwrite=False)
    refuse_used_output_dir(state, tmp_path, "auto", overwrite=False)
    assert choose_checkpoint(None, tmp_path, state) is None
    refuse_used_output_dir(state, tmp_path, None, overwrite=True)  # clears the earlier run
    assert not (tmp_path / "checkpoints").exists()


def test_random_states_of_another_process_count_are_named():
    state = {"num_processes": 2, "data": {"world_size": 2}}
    assert random_state_note(state, RankLayout(num_processes=2)) == ""
    assert "processes 2..3 have none" in random_state_note(state, RankLayout(num_processes=4))
    assert "those of processes 1..1 are not used" in random_state_note(state, RankLayout(num_processes=1))


def test_step_logs_are_removed_for_a_fresh_run_and_cut_for_a_resume(tmp_path):
    rows = "".join(f'{{"step": {s}}}\n' for s in (1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(rows)
    reset_step_logs(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    reset_step_logs(tmp_path, None)
    assert not (tmp_path / "metrics.jsonl").exists()

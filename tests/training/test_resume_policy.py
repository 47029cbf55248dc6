"""The resume policy's parts on their own (training/resume.py); whole resumes: test_resume.py, test_loop.py."""

import pytest

from mmtune.training.layout import RankLayout
from mmtune.training.resume import choose_checkpoint, random_state_note, refuse_used_output_dir, reset_step_logs


def test_a_folder_with_checkpoints_is_not_trained_into_afresh(tmp_path):
    refuse_used_output_dir(tmp_path, None)  # empty: fine
    step = tmp_path / "checkpoints" / "step-2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 2}')
    with pytest.raises(FileExistsError, match="already has checkpoints: set training.resume=auto"):
        refuse_used_output_dir(tmp_path, None)
    refuse_used_output_dir(tmp_path, "auto")
    assert choose_checkpoint(None, tmp_path, print) is None


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

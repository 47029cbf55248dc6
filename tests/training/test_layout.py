"""RankLayout: the run's ranks computed once, as the loop, the resume checks and the plan ask them."""

from types import SimpleNamespace

from mmtune.training.layout import RankLayout


def test_sequence_parallel_groups_share_one_data_rank():
    layout = RankLayout(num_processes=8, process_index=5, sequence_parallel=4, accumulation=2)
    assert (layout.data_ranks, layout.data_rank, layout.micro_batches_per_step) == (2, 1, 4)
    assert [RankLayout(num_processes=8, process_index=i, sequence_parallel=4).data_rank for i in range(8)] == \
        [0, 0, 0, 0, 1, 1, 1, 1]


def test_of_run_reads_the_training_section_and_of_processes_keeps_the_groups():
    training = SimpleNamespace(sequence_parallel=SimpleNamespace(size=2), gradient_accumulation_steps=3)
    layout = RankLayout.of_run(training, num_processes=4, process_index=3)
    assert (layout.sequence_parallel, layout.accumulation, layout.data_ranks, layout.data_rank) == (2, 3, 2, 1)
    other = layout.of_processes(8)
    assert (other.num_processes, other.data_ranks, other.sequence_parallel, other.accumulation) == (8, 4, 2, 3)
    # fewer processes than a group (a plan on 1 GPU): one data rank, never zero
    assert RankLayout(num_processes=1, sequence_parallel=2).data_ranks == 1

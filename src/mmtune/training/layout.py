"""The run's rank layout, computed once: processes, sequence-parallel groups, data-parallel ranks, accumulation.

With ``training.sequence_parallel.size = N`` the ``N`` processes of a group hold the same
rows, so the data is dealt to ``num_processes / N`` data-parallel ranks; the loop, the data
module, the resume checks and ``mmtune plan`` ask this object instead of redoing the
division (torchtitan's ``ParallelDims`` in one small value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    """Where this process sits among the run's processes.

    Example::

        >>> layout = RankLayout(num_processes=8, process_index=5, sequence_parallel=4, accumulation=2)
        >>> layout.data_ranks, layout.data_rank, layout.micro_batches_per_step
        (2, 1, 4)
    """

    num_processes: int
    """Processes of the run (accelerate's ``num_processes``; GPUs in a plan)."""
    process_index: int = 0
    """This process's index among them."""
    sequence_parallel: int = 1
    """Processes sharing one row (``training.sequence_parallel.size``)."""
    accumulation: int = 1
    """Micro-batches per optimizer step on each data rank (``training.gradient_accumulation_steps``)."""

    @classmethod
    def of_run(cls, training: Any, *, num_processes: int, process_index: int = 0) -> "RankLayout":
        """The layout of a run with settings ``training`` (``SFTConfig.training``) on ``num_processes``."""
        return cls(num_processes=num_processes, process_index=process_index,
                   sequence_parallel=max(1, int(training.sequence_parallel.size)),
                   accumulation=int(training.gradient_accumulation_steps))

    @property
    def data_ranks(self) -> int:
        """Data-parallel ranks: groups of ``sequence_parallel`` processes, each fed its own micro-batches."""
        return max(1, self.num_processes // self.sequence_parallel)

    @property
    def data_rank(self) -> int:
        """This process's data-parallel rank (every process of a sequence-parallel group has the same)."""
        return self.process_index // self.sequence_parallel

    @property
    def micro_batches_per_step(self) -> int:
        """Micro-batches of one optimizer step over every data rank (the global batch)."""
        return self.accumulation * self.data_ranks

    def of_processes(self, num_processes: int) -> "RankLayout":
        """The same groups and accumulation on another number of processes (a checkpoint's, a resume's)."""
        return RankLayout(num_processes=num_processes, process_index=0, sequence_parallel=self.sequence_parallel,
                          accumulation=self.accumulation)

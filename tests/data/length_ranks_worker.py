"""One rank of the shared length pass (tests/data/test_lengths.py): ``python length_ranks_worker.py
RANK WORLD INIT_FILE CACHE OUT [FAILING_RANK]`` measures its share through a gloo process group and
writes what it measured and the table it got (or the error it stopped with)."""

import json
import sys

import torch.distributed as dist

from mmtune.data import lengths as lengths_module
from mmtune.data.lengths import compute_lengths
from mmtune.models.config import ModelConfig
from mmtune.models.registry import build_adapter
from tests.data.test_lengths import _dialogues

rank, world, init_file, cache, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
failing = int(sys.argv[6]) if len(sys.argv) > 6 else None
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
measured = []
real = lengths_module._lengths_of_range


def counting(adapter, dialogues, bounds, **kw):
    if rank == failing:
        raise ValueError(f"rank {rank} cannot measure {bounds}")
    measured.append(list(bounds))
    return real(adapter, dialogues, bounds, **kw)


lengths_module._lengths_of_range = counting
try:
    table = compute_lengths(build_adapter(ModelConfig(family="llava", image_size=336)), _dialogues(), max_length=4096,
                            chunk_size=7, cache_dir=cache, fingerprint="forty", rank=rank, world_size=world,
                            barrier=dist.barrier)
    result = {"measured": measured, "lengths": table.lengths.tolist(), "stats": table.stats}
except (ValueError, RuntimeError) as err:
    result = {"error": f"{type(err).__name__}: {err}"}
with open(out, "w") as f:
    json.dump(result, f)
dist.destroy_process_group()

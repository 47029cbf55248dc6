"""Save twice into one run directory and die by SIGKILL at a named point of the second save.

``python save_worker.py OUT_DIR SCENARIO POINT``, used by test_checkpoint.py:

- ``resave``: checkpoint step 2 (version A), then step 2 again (version B);
- ``next``: checkpoint step 1 (A), then step 2 (B) with ``keep_last=1`` (prunes step 1);
- ``final``: ``final/`` (A), then ``final/`` again (B).

Before the second save, ``OUT_DIR/expected.pt`` records both versions' weights.
"""

import os
import signal
import sys
from pathlib import Path

import torch


class TinyPretrained(torch.nn.Module):
    """A module with the ``save_pretrained`` that ``save_final`` calls."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)

    def save_pretrained(self, path, state_dict=None, safe_serialization=True):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in (state_dict or self.state_dict()).items()},
                  os.path.join(path, "model.safetensors"))


def main() -> None:
    from accelerate import Accelerator

    from mmtune.training.checkpoint import CheckpointManager, save_final

    out, scenario, point = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

    def die_at(reached: str) -> None:
        if reached == point:
            os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = TinyPretrained()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    versions = {}

    def save(version: str, hook=None) -> None:
        if scenario == "final":
            save_final(accelerator, model, out / "final", save_pretrained_extras=[], metadata={"version": version},
                       on_save_point=hook)
        else:
            step = 2 if scenario == "resave" or version == "B" else 1
            manager = CheckpointManager(out, keep_last=1 if scenario == "next" else 2, on_save_point=hook)
            manager.save(accelerator, step, {"version": version})

    versions["A"] = {k: v.clone() for k, v in model.state_dict().items()}
    save("A")
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    versions["B"] = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(versions, out / "expected.pt")
    save("B", die_at)


if __name__ == "__main__":
    main()

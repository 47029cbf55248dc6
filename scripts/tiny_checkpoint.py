"""Write a tiny random-weight checkpoint of one of transformers' image-text classes, for the
``auto`` family's ``configs/model/<class>_tiny.yaml`` (tests build their own in a temporary
folder).

Usage::

    python scripts/tiny_checkpoint.py internvl                     # -> outputs/tiny/internvl
    python scripts/tiny_checkpoint.py glm4v --out /tmp/glm4v_tiny

Classes: those of ``mmtune.testing.checkpoints.KINDS`` (``--help`` lists them).
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> str:
    from mmtune.testing.checkpoints import KINDS, save_tiny_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS), help="the transformers class to build")
    parser.add_argument("--out", default=None, help="checkpoint directory (default: outputs/tiny/<kind>)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    directory = save_tiny_checkpoint(args.out or f"outputs/tiny/{args.kind}", args.kind, seed=args.seed)
    print(directory)
    return directory


if __name__ == "__main__":
    main()

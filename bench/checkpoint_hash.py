"""What the checkpoint manifest's content hashes cost: seconds per GB to hash, beside reading.

    python bench/checkpoint_hash.py --mb 512

Writes one file of random bytes, then, side by side on the same file (in the page cache
after the first pass): a plain read in the manifest's chunks, and each hash of
:data:`mmtune.training.manifest.HASHES` (XXH3-128 from ``xxhash``, BLAKE2b-128 from the
standard library). A save hashes every file once after writing it (files in parallel
threads); a resume hashes every file of the checkpoint it loads, once.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from mmtune.training.manifest import _CHUNK, HASHES, file_hash


def _read(path: str) -> None:
    with open(path, "rb") as handle:
        while handle.read(_CHUNK):
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="size of the file hashed")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many passes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "weights.bin")
        with open(path, "wb") as handle:
            for _ in range(args.mb):
                handle.write(os.urandom(1 << 20))
        gb = args.mb / 1024
        timings = {"read only": lambda: _read(path)}
        for name in HASHES:
            timings[name] = lambda name=name: file_hash(path, name)
        _read(path)  # into the page cache, so every row measures the same thing
        print(f"{args.mb} MiB file, best of {args.repeats}, one thread")
        base = None
        for label, run in timings.items():
            best = min(_timed(run) for _ in range(args.repeats))
            base = base or best
            print(f"  {label:<12} {best / gb:7.3f} s/GB  {gb / best:7.2f} GB/s  ({best / base:5.1f}x the plain read)")


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()

"""The squashfs compression level of an image, side by side on one root: the time to build the SIF, its size and
the time a rank's imports take inside it (what images/repro.mksquashfs_args chooses between).

    python tests/benchmarks/squash_level.py SIF [--levels 15 3] [--builds 2] [--imports 6]

Unpacks SIF into a sandbox once, builds a SIF from it at each zstd level in turn (`--builds` rounds, levels
interleaved), then times `import jax, orbax.checkpoint; from maxtext.trainers.pre_train import train` in each
(`--imports` rounds, interleaved). Prints one line per level: build seconds (median, lowest-highest), bytes,
import seconds (median, lowest-highest); the last line is each level's import median over the first level's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rkit.images import repro as imagerepro
from rkit.images.store import apptainer

IMPORTS = "import jax, orbax.checkpoint; from maxtext.trainers.pre_train import train"


def timed(argv: list[str]) -> float:
    began = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True)
    return time.monotonic() - began


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sif", type=Path)
    parser.add_argument("--levels", type=int, nargs="+", default=[15, 3])
    parser.add_argument("--builds", type=int, default=2)
    parser.add_argument("--imports", type=int, default=6)
    args = parser.parse_args()
    exe = apptainer()
    with tempfile.TemporaryDirectory(prefix="rkit-squash-") as tmp:
        root, sifs = Path(tmp) / "root", {level: Path(tmp) / f"level-{level}.sif" for level in args.levels}
        subprocess.run([exe, "build", "--sandbox", str(root), str(args.sif)], check=True, capture_output=True)
        builds: dict[int, list[float]] = {level: [] for level in args.levels}
        imports: dict[int, list[float]] = {level: [] for level in args.levels}
        for _ in range(args.builds):
            for level in args.levels:
                builds[level].append(timed([exe, "build", "--force", "--mksquashfs-args",
                                            imagerepro.mksquashfs_args(level), str(sifs[level]), str(root)]))
        for _ in range(args.imports):
            for level in args.levels:
                imports[level].append(timed([exe, "exec", str(sifs[level]), "/opt/venv/bin/python", "-c", IMPORTS]))
        for level in args.levels:
            print(f"level {level}: build {spread(builds[level])}, {sifs[level].stat().st_size:,} bytes, "
                  f"imports {spread(imports[level])}")
        first = statistics.median(imports[args.levels[0]])
        print(f"imports over level {args.levels[0]}: " + ", ".join(
            f"level {level} {statistics.median(imports[level]) / first:.3f}" for level in args.levels))


if __name__ == "__main__":
    main()

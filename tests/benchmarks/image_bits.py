"""Which bytes of two images differ: for two builds of the same inputs (issue: bit-reproducible images).

    python tests/benchmarks/image_bits.py A.sif B.sif          # two SIFs you built
    python tests/benchmarks/image_bits.py --build cpu          # builds FLAVOR twice, cold, into temporary caches

Prints both sha256s and, when they differ, the SIF header fields and data objects that differ (imagerepro.objects)
and, for a differing squashfs, every file whose metadata (`unsquashfs -lln`) or content differs.
The last line is `identical` or `differ: <n> files`.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchruns import REPO

from rkit.images import repro as imagerepro
from rkit.images.store import sha256_file


def build(flavor: str, cache: Path) -> tuple[Path, float]:
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "rkit.cli", "image", "build", flavor], cwd=REPO, check=True,
                          capture_output=True, text=True, env={**os.environ, "RKIT_IMAGE_CACHE": str(cache)})
    return Path(done.stdout.strip().splitlines()[-1]), time.monotonic() - began


def listing(sif: Path, offset: int) -> dict[str, str]:
    out = subprocess.run(["unsquashfs", "-o", str(offset), "-lln", str(sif)], capture_output=True, text=True,
                         check=True).stdout
    files = {}
    for line in out.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("squashfs-root"):
            files[parts[5]] = " ".join(parts[:5])
    return files


def squashfs_offset(sif: Path) -> int:
    for name, obj in imagerepro.objects(sif).items():
        if name != "header" and obj["type"] == "0x4004":
            return obj["offset"]
    raise SystemExit(f"{sif}: no squashfs partition")


def file_differences(a: Path, b: Path) -> list[str]:
    out = []
    la, lb = listing(a, squashfs_offset(a)), listing(b, squashfs_offset(b))
    for path in sorted(set(la) | set(lb)):
        if la.get(path) != lb.get(path):
            out.append(f"metadata {path}: {la.get(path)} | {lb.get(path)}")
    with tempfile.TemporaryDirectory(prefix="rkit-bits-", dir=a.parent) as tmp:
        roots = []
        for sif, name in ((a, "a"), (b, "b")):
            subprocess.run(["unsquashfs", "-q", "-o", str(squashfs_offset(sif)), "-d", f"{tmp}/{name}", str(sif)],
                           check=True, capture_output=True)
            roots.append(Path(tmp) / name)

        def walk(cmp: filecmp.dircmp, rel: str) -> None:
            out.extend(f"content {rel}/{f}" for f in cmp.diff_files)
            out.extend(f"only in one {rel}/{f}" for f in cmp.left_only + cmp.right_only)
            for sub, c in cmp.subdirs.items():
                walk(c, f"{rel}/{sub}")

        walk(filecmp.dircmp(roots[0], roots[1], ignore=[]), "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", nargs="*", type=Path)
    parser.add_argument("--build", metavar="FLAVOR")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rkit-bits-", dir=str(Path.home() / ".cache")) as tmp:
        if args.build:
            images = []
            for k in (1, 2):
                sif, seconds = build(args.build, Path(tmp) / f"cache{k}")
                print(f"build {k}: {seconds:.0f} s, {sif.stat().st_size} bytes", flush=True)
                images.append(sif)
        else:
            images = args.images
        a, b = images
        da, db = sha256_file(a), sha256_file(b)
        print(f"A {da}\nB {db}")
        if da == db:
            print("identical")
            return
        oa, ob = imagerepro.objects(a), imagerepro.objects(b)
        for key in sorted(set(oa) | set(ob)):
            if oa.get(key) != ob.get(key):
                print(f"{key}: {oa.get(key)} | {ob.get(key)}")
        files = file_differences(a, b)
        for line in files:
            print(line)
        print(f"differ: {len(files)} files")


if __name__ == "__main__":
    main()

"""Bit-reproducible images: two builds of the same definition, locks and mirror give the same SIF bytes.

What a build stamps, and how rkit keeps each out (Apptainer 1.4, mksquashfs 4.5; Apptainer 1.5 reads
SOURCE_DATE_EPOCH itself and then does the SIF part on its own):
  - every time in the image: one SOURCE_DATE_EPOCH for the build, the snapshot mirror's date from the
    definition's MIRROR default (the same for every build of the same inputs, whichever mirror is used). The
    definition compiles every .pyc as an unchecked hash-based one (PEP 552: no time in it), the build-date
    labels and /etc/rkit/image.json
    carry that date instead of the clock, and mksquashfs (>= 4.5, which reads it from the environment) takes it
    as the file system's time and clamps every later file time to it: what the build wrote gets that time, what
    came from a .deb keeps the package's (so Debian's timestamp-checked .pyc files stay valid, as long as no
    locked package is newer than the snapshot date). Its output is otherwise deterministic (`-reproducible` is
    its default);
  - what the build leaves behind: logs, apt's caches and lists, the .debs, dpkg's and the password files' backups,
    ldconfig's aux cache, and the last-change days in /etc/shadow (the definition's %post removes or fixes them);
  - the SIF's own header: a random UUID and creation times in the global header and every descriptor, and the
    builder's uid and gid in every descriptor. `normalize_sif` sets them as the SIF library's
    OptCreateDeterministic would (nil UUID) with the times at SOURCE_DATE_EPOCH and uid/gid 0.
The wall-clock time of a build is in the image cache's record (`built`), not in the image.
"""

from __future__ import annotations

import calendar
import hashlib
import re
import struct
import time
from pathlib import Path

SNAPSHOT = re.compile(r"/archive/debian/(\d{8}T\d{6})Z")
DEFAULT_EPOCH = 1767225600  # 2026-01-01T00:00:00Z: for a definition without a snapshot mirror

HEADER = struct.Struct("<32s10s3s3s16sqqqqqqqq")  # the SIF global header (sif/v2 pkg/sif/sif.go: header)
DESCRIPTOR = struct.Struct("<i?IIIqqqqqqq128s384s")  # one descriptor (pkg/sif/descriptor.go: rawDescriptor)
MAGIC = b"SIF_MAGIC\0"


def source_date_epoch(mirror_default: str) -> int:
    """The build's one time: the snapshot date of the definition's default mirror (a dated snapshot of Debian
    is what the image's packages come from), else a fixed date."""
    match = SNAPSHOT.search(mirror_default or "")
    if not match:
        return DEFAULT_EPOCH
    return calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%S"))


def iso(epoch: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def mksquashfs_args(level: int = 3) -> str:
    """zstd (the times come from SOURCE_DATE_EPOCH in mksquashfs's environment): a rank's imports read ~1 GB of
    the image (jaxlib, MaxText), decompressed again at every container start. Measured (cpu image, import of
    JAX, Orbax and MaxText's trainer, median of 6): 11.8 s gzip (Apptainer's default, 554 MB), 9.1 s zstd
    (501 MB), 8.4 s lz4 (778 MB), 7.3 s from the host's venv. Level 3 (zstd's own default; mksquashfs's is 15):
    the same root squashed side by side (2026-12-02), level 15 took 97-103 s for 445 MB and level 3 18.7-18.9 s
    for 510 MB, and the imports above took 8.60 s and 8.31 s (medians of 6, interleaved). Part of the image's
    cache key (images/build.py): other arguments, other bytes."""
    return f"-comp zstd -Xcompression-level {level}"


def normalize_sif(path: Path, epoch: int) -> dict[str, int]:
    """Rewrite the SIF header fields a build stamps (UUID, times, the builder's uid/gid) in place; returns how
    many fields changed. Refuses a file that is not a SIF."""
    changed = {"id": 0, "times": 0, "owners": 0}
    with open(path, "r+b") as fh:
        raw = fh.read(HEADER.size)
        if len(raw) != HEADER.size or raw[32:42] != MAGIC:
            raise ValueError(f"{path}: not a SIF file (no SIF_MAGIC in its header)")
        h = list(HEADER.unpack(raw))
        if h[4] != bytes(16):
            h[4], changed["id"] = bytes(16), 1
        for i in (5, 6):
            if h[i] != epoch:
                h[i] = epoch
                changed["times"] += 1
        fh.seek(0)
        fh.write(HEADER.pack(*h))
        total, offset = h[8], h[9]
        for k in range(total):
            fh.seek(offset + k * DESCRIPTOR.size)
            d = list(DESCRIPTOR.unpack(fh.read(DESCRIPTOR.size)))
            if not d[1]:  # unused slot
                continue
            for i in (8, 9):
                if d[i] != epoch:
                    d[i] = epoch
                    changed["times"] += 1
            for i in (10, 11):
                if d[i] != 0:
                    d[i] = 0
                    changed["owners"] += 1
            fh.seek(offset + k * DESCRIPTOR.size)
            fh.write(DESCRIPTOR.pack(*d))
    return changed


def objects(path: Path) -> dict[str, dict]:
    """The SIF's header fields and each data object's type, name, size and sha256 (for saying which bytes of
    two images differ)."""
    out: dict[str, dict] = {}
    with open(path, "rb") as fh:
        h = HEADER.unpack(fh.read(HEADER.size))
        out["header"] = {"id": h[4].hex(), "created": h[5], "modified": h[6]}
        for k in range(h[8]):
            fh.seek(h[9] + k * DESCRIPTOR.size)
            d = DESCRIPTOR.unpack(fh.read(DESCRIPTOR.size))
            if not d[1]:
                continue
            fh.seek(d[5])
            digest, left = hashlib.sha256(), d[6]
            while left > 0:
                chunk = fh.read(min(left, 1 << 20))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
            out[f"object {d[2]}"] = {"type": hex(d[0]), "name": d[12].rstrip(b"\0").decode(errors="replace"),
                                     "offset": d[5],
                                     "size": d[6], "sha256": digest.hexdigest(), "created": d[8], "uid": d[10]}
    return out

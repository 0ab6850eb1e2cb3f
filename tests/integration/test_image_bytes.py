"""Bit-reproducible images at their smallest real size: the base image (containers/base.def) built twice from
nothing. Its own module, so that it runs beside the cpu image's build (tests/conftest.py puts the modules that need
that image in the other xdist group)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from rkit.images.store import image_info, sha256_file

from ..conftest import MIRROR, require_apptainer, rkit

pytestmark = [pytest.mark.slow]


def test_the_base_image_built_twice_from_nothing_is_the_same_bytes(tmp_path: Path):
    """Bit-reproducibility at its smallest real size: containers/base.def is cpu.def with only setuptools in its
    lock (a unit test holds them to that), so two cold builds in two caches run the same machinery (debootstrap
    from the mirror, the Debian lock check, SOURCE_DATE_EPOCH, pip --require-hashes, compileall, rkit's stamps,
    the cleanup, squashfs times, the SIF header) in about a minute each. The full cpu image: make verify-image.
    Budget: two cold builds of the smallest image (debootstrap, pip, squashfs) side by side, about a minute each on
    a quiet machine.
    """
    from rkit.images import repro as imagerepro

    require_apptainer()

    def build(name: str) -> Path:
        done = rkit("image", "build", "base", *MIRROR, env={"RKIT_IMAGE_CACHE": str(tmp_path / name)},
                    timeout=1800, check=0)
        path = Path(done.stdout.strip().splitlines()[-1])
        assert path.parent == tmp_path / name and "built in" in done.stderr
        return path

    # At the same time: each build is mostly one core's work (debootstrap, pip, compileall's shards aside), and the
    # two share nothing but the mirror.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        built = list(pool.map(build, ("first", "second")))
    first_objects, second_objects = imagerepro.objects(built[0]), imagerepro.objects(built[1])
    assert sha256_file(built[0]) == sha256_file(built[1]), (first_objects, second_objects)
    assert first_objects["header"]["id"] == "0" * 32  # nil UUID, times at SOURCE_DATE_EPOCH
    info = image_info(built[0])
    assert info["flavor"] == "base" and info["debian_lock_sha256"].startswith("sha256:")
    assert set(info["packages"]) >= {"setuptools", "rkit"} and "jax" not in info["packages"]

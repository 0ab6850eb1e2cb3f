"""Reproducible images, the parts that need no build: the Debian lock check (debianlock), the SIF header rewrite
(imagerepro) and the one environment identity an image's label and rkit's probe share (envscan). The builds
themselves: tests/integration/test_images.py."""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

import pytest

from rkit.images import env as imageenv
from rkit.images import probe as imageagent
from rkit.images import repro as imagerepro
from rkit.runtime import debianlock, envscan

STATUS = """Package: libc6
Status: install ok installed
Architecture: amd64
Version: 2.41-12

Package: tzdata
Status: install ok installed
Architecture: all
Version: 2025b-4

Package: gone
Status: deinstall ok config-files
Architecture: amd64
Version: 1.0
"""


def fake_root(tmp_path: Path, libc: str = "2.41-12") -> tuple[Path, Path]:
    status, archives = tmp_path / "status", tmp_path / "archives"
    status.write_text(STATUS.replace("2.41-12", libc))
    archives.mkdir()
    (archives / f"libc6_{libc}_amd64.deb").write_bytes(b"libc " + libc.encode())
    (archives / "tzdata_2025b-4_all.deb").write_bytes(b"tz")
    return status, archives


def test_the_debian_lock_names_every_package_that_is_not_as_locked(tmp_path: Path):
    status, archives = fake_root(tmp_path)
    found = debianlock.installed(str(status), str(archives))
    assert found == {"libc6": ("2.41-12", "sha256:" + hashlib.sha256(b"libc 2.41-12").hexdigest()),
                     "tzdata": ("2025b-4", "sha256:" + hashlib.sha256(b"tz").hexdigest())}
    lock = debianlock.parse(debianlock.render(found))
    assert lock == found and debianlock.differences(lock, found) == []
    (tmp_path / "b").mkdir()
    newer, _ = fake_root(tmp_path / "b", "2.41-13")
    later = debianlock.installed(str(newer), str(tmp_path / "b" / "archives"))
    later["curl"] = ("8.14-1", "-")
    assert debianlock.differences(lock, later) == ["curl (not in the lock) -> 8.14-1", "libc6 2.41-12 -> 2.41-13"]
    tampered = {**found, "tzdata": ("2025b-4", "sha256:" + "0" * 64)}
    assert debianlock.differences(lock, tampered) == [
        f"tzdata 2025b-4: .deb {found['tzdata'][1]} -> sha256:{'0' * 64}"]
    assert debianlock.differences(lock, {"libc6": found["libc6"]}) == ["tzdata 2025b-4 -> (not installed)"]


REAL_INSTALLED = debianlock.installed


def test_a_build_with_other_debian_packages_stops_naming_them_and_refresh_takes_them(tmp_path: Path, monkeypatch,
                                                                                     capsys):
    status, archives = fake_root(tmp_path, "2.41-13")
    monkeypatch.setattr(debianlock, "installed", lambda: REAL_INSTALLED(str(status), str(archives)))
    lock = tmp_path / "debian-trixie.txt"
    lock.write_text("libc6 2.41-12 -\ntzdata 2025b-4 -\n")
    out = tmp_path / "etc" / "debian.lock"
    assert debianlock.main([str(lock), str(out), "--name", "containers/lock/debian-trixie.txt"]) == 1
    err = capsys.readouterr().err
    assert "containers/lock/debian-trixie.txt (1 differences)" in err and "libc6 2.41-12 -> 2.41-13" in err
    assert "make lock" in err
    assert debianlock.parse(out.read_text())["libc6"][0] == "2.41-13"  # the image's own record, written anyway
    assert debianlock.main([str(lock), str(out), "--refresh"]) == 0
    assert debianlock.main([str(out), str(tmp_path / "again"), "--name", "x"]) == 0  # the refreshed lock passes
    assert debianlock.main([str(tmp_path / "missing"), str(out), "--name", "x"]) == 1
    assert "x is empty or missing" in capsys.readouterr().err


def sif_bytes(uuid: bytes, t: int, uid: int) -> bytes:
    header = imagerepro.HEADER.pack(b"#!/usr/bin/env run-singularity\n".ljust(32, b"\0"), imagerepro.MAGIC, b"01\0",
                                    b"02\0", uuid, t, t, 46, 48, 4096, 48 * imagerepro.DESCRIPTOR.size, 32768, 3)
    used = imagerepro.DESCRIPTOR.pack(0x4004, True, 1, 0x1000001, 0, 32768, 3, 3, t, t, uid, uid,
                                      b"".ljust(128, b"\0"), b"".ljust(384, b"\0"))
    free = bytes(imagerepro.DESCRIPTOR.size)
    body = header.ljust(4096, b"\0") + used + free * 47
    return body.ljust(32768, b"\0") + b"abc"


def test_two_sif_headers_that_differ_only_in_what_a_build_stamps_are_the_same_bytes_once_normalized(tmp_path):
    a, b = tmp_path / "a.sif", tmp_path / "b.sif"
    a.write_bytes(sif_bytes(b"\x01" * 16, 1796000000, 1000))
    b.write_bytes(sif_bytes(b"\x02" * 16, 1796000999, 0))
    assert a.read_bytes() != b.read_bytes()
    epoch = imagerepro.source_date_epoch("http://snapshot.debian.org/archive/debian/20261101T000000Z/")
    assert imagerepro.normalize_sif(a, epoch) == {"id": 1, "times": 4, "owners": 2}
    assert imagerepro.normalize_sif(b, epoch) == {"id": 1, "times": 4, "owners": 0}
    assert a.read_bytes() == b.read_bytes()
    assert imagerepro.normalize_sif(a, epoch) == {"id": 0, "times": 0, "owners": 0}  # idempotent
    objs = imagerepro.objects(a)
    assert objs["header"] == {"id": "0" * 32, "created": epoch, "modified": epoch}
    assert objs["object 1"]["sha256"] == hashlib.sha256(b"abc").hexdigest()
    bad = tmp_path / "not.sif"
    bad.write_bytes(b"x" * 200)
    with pytest.raises(ValueError, match="not a SIF"):
        imagerepro.normalize_sif(bad, epoch)
    assert imagerepro.source_date_epoch("http://deb.debian.org/debian") == imagerepro.DEFAULT_EPOCH
    assert struct.calcsize("<32s10s3s3s16sqqqqqqqq") == 128 and imagerepro.DESCRIPTOR.size == 585


def test_an_images_label_and_rkits_probe_compute_one_identity(tmp_path: Path):
    # The probe is envscan's own text plus a few lines: run it here as the image would.
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-c", imageagent.PROBE, json.dumps(["__init__.py"])],
                          capture_output=True, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["packages"] == envscan.python_packages() and found["debian"] == envscan.debian_packages()
    labels = {"org.rkit.definition.sha256": "sha256:d", "org.rkit.lock.sha256": "sha256:l",
              "org.rkit.debian-lock.sha256": "sha256:b"}
    host = imageenv.identity(imageenv.environment(found, labels))
    inside = envscan.identity(envscan.environment(sys.version.split()[0], envscan.python_packages(),
                                                  envscan.debian_packages(), "sha256:d", "sha256:l", "sha256:b"))
    assert host == inside
    # An image from before the Debian lock (no such label) keeps the identity it was recorded with.
    old = {k: v for k, v in labels.items() if "debian" not in k}
    assert "debian_lock_sha256" not in imageenv.environment(found, old)["build"]

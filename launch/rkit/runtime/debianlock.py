"""The Debian side of an image pinned: the packages a debootstrapped image installs, with versions and the
sha256 of each .deb, checked against containers/lock/debian-trixie.txt (bases.json's debian_lock) while the image
is built.

    python3 -m rkit.runtime.debianlock LOCK OUT [--name NAME] [--refresh]   (in the image's %post, Debian's own python3)

Reads dpkg's status file and the .debs debootstrap left in /var/cache/apt/archives (each one's sha256, the same
digest apt checked against the mirror's signed Packages index), writes them to OUT (the image's own record,
/etc/rkit/debian.lock), and compares them with LOCK: a package added, removed, at another version or with
another .deb digest stops the build (exit 1) with the difference, unless --refresh (`make lock`), which takes
what was installed as the new lock. A snapshot mirror gives the same packages for ever; the plain mirror moves
with Debian's point releases and security updates, and this check is what says so.

Standard library only: it runs before the image's venv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

from rkit.runtime.envscan import debian_packages

ARCHIVES = "/var/cache/apt/archives"
HEADER = """\
# The Debian packages of the images debootstrapped from Debian trixie (cpu, cuda), as debootstrap installed
# them: name version sha256-of-the-.deb. Checked while an image is built (rkit.runtime.debianlock); a build that
# installs anything else stops with the difference. Refresh with `make lock`
# (`rkit image build cpu --refresh-debian-lock`).
"""


def deb_file(name: str, version: str, arch: str, archives: str = ARCHIVES) -> str:
    """Where apt and debootstrap keep a package's .deb (an epoch's ':' is written %3a)."""
    return os.path.join(archives, f"{name.split(':')[0]}_{version.replace(':', '%3a')}_{arch}.deb")


def architectures(status: str) -> dict[str, str]:
    archs = {}
    with open(status, encoding="utf-8", errors="replace") as fh:
        for block in fh.read().split("\n\n"):
            fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line[:1].isspace())
            if fields.get("Package"):
                arch = fields.get("Architecture", "")
                qualified = fields["Package"] + (":" + arch if arch not in ("", "all", "amd64") else "")
                archs[qualified] = arch
    return archs


def installed(status: str = "/var/lib/dpkg/status", archives: str = ARCHIVES) -> dict[str, tuple[str, str]]:
    """{package: (version, sha256 of its .deb or '-' when the .deb is not kept)}."""
    archs = architectures(status) if os.path.exists(status) else {}
    out = {}
    for name, version in debian_packages(status).items():
        path = deb_file(name, version, archs.get(name, "amd64"), archives)
        try:
            with open(path, "rb") as fh:
                digest = "sha256:" + hashlib.file_digest(fh, "sha256").hexdigest()
        except OSError:
            digest = "-"
        out[name] = (version, digest)
    return out


def parse(text: str) -> dict[str, tuple[str, str]]:
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and not line.startswith("#"):
            out[fields[0]] = (fields[1], fields[2])
    return out


def render(packages: dict[str, tuple[str, str]]) -> str:
    return HEADER + "".join(f"{n} {v} {h}\n" for n, (v, h) in sorted(packages.items()))


def differences(lock: dict[str, tuple[str, str]], found: dict[str, tuple[str, str]]) -> list[str]:
    """Pure: one line per package that is not as the lock says ('-' digests are not compared)."""
    out = []
    for name in sorted(set(lock) | set(found)):
        if name not in found:
            out.append(f"{name} {lock[name][0]} -> (not installed)")
        elif name not in lock:
            out.append(f"{name} (not in the lock) -> {found[name][0]}")
        elif lock[name][0] != found[name][0]:
            out.append(f"{name} {lock[name][0]} -> {found[name][0]}")
        elif "-" not in (lock[name][1], found[name][1]) and lock[name][1] != found[name][1]:
            out.append(f"{name} {found[name][0]}: .deb {lock[name][1]} -> {found[name][1]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m rkit.runtime.debianlock")
    parser.add_argument("lock")
    parser.add_argument("out")
    parser.add_argument("--name", default="containers/lock/debian-trixie.txt", help="the lock as the user knows it")
    parser.add_argument("--refresh", action="store_true")
    args = parser.parse_args(argv)
    found = installed()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(render(found))
    if args.refresh:
        print(f"rkit: Debian lock refreshed: {len(found)} packages (in the image at {args.out})")
        return 0
    try:
        with open(args.lock, encoding="utf-8") as fh:
            lock = parse(fh.read())
    except OSError:
        lock = {}
    changed = differences(lock, found) if lock else [f"{args.name} is empty or missing"]
    if changed:
        sys.stderr.write(f"rkit: the Debian packages of this build are not those of {args.name} "
                         f"({len(changed)} differences):\n  " + "\n  ".join(changed) +
                         "\nThe mirror serves other packages than when the lock was made. Build from the lock's "
                         "snapshot mirror (--build-arg MIRROR=...), or take these as the new lock with `make lock` "
                         "(`rkit image build cpu --refresh-debian-lock`).\n")
        return 1
    print(f"rkit: Debian packages as locked: {len(found)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

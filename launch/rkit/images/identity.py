"""What a run records about its image (ImageIdentity, checked again before every attempt), and how a recipe's
`image:` value becomes one: a flavor name resolves to the cached image built from the current definition, lock and
image side (images/build.py's key), a path to that SIF; the image's Python, agent and environment come from its
probe (images/probe.py, images/env.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rkit.contract.errors import RkitError
from rkit.images import env as imageenv
from rkit.images.build import ANY_MIRROR, plan_build
from rkit.images.probe import probe
from rkit.images.store import (
    FLAVORS,
    GPU_FLAGS,
    LABEL_PREFIX,
    apptainer,
    bases,
    cache_dir,
    labels,
    require_file,
    sha256_file,
)


class ImageNotBuilt(RkitError):
    """No image of the recipe's flavor is built from the current definition, lock and rkit (exit 2)."""


@dataclass
class ImageIdentity:
    """What a run records about its image, and checks again before every attempt."""

    reference: str
    path: str
    sha256: str
    flavor: str | None
    labels: dict[str, str] = field(default_factory=dict)
    size_bytes: int = 0
    python: str = "/opt/venv/bin/python"  # the image's Python that runs the ranks (imageagent.probe)
    agent: str = "image"  # "image": its own rkit agent (the same files as this rkit's); "bound": rkit brings it
    environment_sha256: str | None = None  # what it holds (imageenv.identity), beside the file digest
    environment: dict[str, Any] | None = None  # build (Python, definition, lock), python and debian packages

    @property
    def gpu_flags(self) -> list[str]:
        return GPU_FLAGS.get(self.flavor or "cpu", [])

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "sif", **asdict(self)}

    def check_unchanged(self) -> ImageIdentity | None:
        """Before every attempt: the SIF must be the one the run was stamped with, or a rebuild of it that holds
        the same environment (imageenv): None when the file is the same, the rebuilt image's identity when it
        holds the same environment; else RkitError naming the packages that changed."""
        if not Path(self.path).is_file():
            raise RkitError(f"{self.path}: the run's image is gone (expected {self.sha256}); restore it or "
                            "rebuild it with the same definition and lock.")
        found = sha256_file(Path(self.path))
        if found == self.sha256:
            return None
        try:
            other = identify(self.reference, Path(self.path), found)
        except RkitError as exc:
            raise RkitError(f"{self.path}: image digest mismatch: expected {self.sha256}, found {found}, and its "
                            f"environment could not be read ({exc}). Use the image the run was made with.") from None
        return self.same_environment(other)

    def same_environment(self, found: ImageIdentity) -> ImageIdentity:
        """`found` (another file) when it holds this image's environment; else RkitError with what changed."""
        same, _, what = imageenv.compare({"environment_sha256": self.environment_sha256,
                                          "environment": self.environment},
                                         found.environment_sha256, found.environment)
        if same:
            return found
        raise RkitError(f"{found.path}: image digest mismatch: expected {self.sha256}, found {found.sha256}, and "
                        f"it holds another environment: {what}. Use the image the run was made with (or one "
                        "rebuilt from the same definition and lock), or accept the change explicitly.")


def cached_records(flavor: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted(cache_dir().glob(f"{flavor}-*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:
            continue
        if record.get("flavor") == flavor and Path(record.get("path", "")).is_file():
            records.append(record)
    return sorted(records, key=lambda r: r.get("built", 0), reverse=True)


def _current_plan(flavor: str):
    """The build the current definition, lock and rkit make of `flavor`. Which mirror does not matter here (its
    key material is compared without build_args); naming one skips the reachability probe, and it must pass
    plan_build's MIRROR check like any other."""
    return plan_build(flavor, {"MIRROR": ANY_MIRROR} if bases()[flavor]["bootstrap"] == "debootstrap" else None)


def resolve_flavor(flavor: str, want_sha256: str | None = None) -> Path:
    """The cached image of this flavor built from the current definition and lock (or with a given digest)."""
    records = cached_records(flavor)
    if want_sha256:
        for record in records:
            if record["sha256"] == want_sha256:
                return _unchanged(record)
    plan = _current_plan(flavor)
    same = ("definition_sha256", "lock_sha256", "base_reference", "base_digest", "rkit_agent_sha256")
    current = [r for r in records if all(r["key_material"].get(k) == plan.key_material[k] for k in same)]
    if not current:
        raise ImageNotBuilt(f"image {flavor!r}: no {flavor} image built from the current containers/{flavor}.def, its "
                        f"lock and this rkit in {cache_dir()}; build it with `make image FLAVOR={flavor}`.")
    return _unchanged(current[0])


def _unchanged(record: dict[str, Any]) -> Path:
    """A cached image is used only while its digest is the one recorded when it was built."""
    path = Path(record["path"])
    found = sha256_file(path)
    if found != record.get("sha256"):
        raise RkitError(f"{path}: the cached {record.get('flavor')} image changed after it was built (recorded "
                        f"{record.get('sha256')}, found {found}); something replaced or damaged it. Rebuild it "
                        f"with `rkit image build {record.get('flavor')} --force`.")
    return path


def locate(reference: str, want_sha256: str | None = None) -> Path | None:
    """Where a recipe's `image:` value points: None for 'none', the cache for a flavor name (the image with
    `want_sha256` if cached), else a SIF path (relative paths are relative to the current directory)."""
    if reference == "none":
        return None
    apptainer()  # missing apptainer: say so before anything is created
    if reference in FLAVORS:
        return resolve_flavor(reference, want_sha256).resolve()
    return require_file(Path(reference).expanduser()).resolve()


def identify(reference: str, path: Path, sha256: str | None = None) -> ImageIdentity:
    sha256 = sha256 or sha256_file(path)
    inside = probe(apptainer(), str(path), sha256)
    # The labels as the image holds them (memoised with the probe: no `apptainer inspect` per run).
    found = inside["labels"] if isinstance(inside.get("labels"), dict) else labels(path)
    env = imageenv.environment(inside, found)
    return ImageIdentity(reference=reference, path=str(path), sha256=sha256,
                         flavor=found.get(LABEL_PREFIX + "flavor") or inside["flavor"],
                         labels={k: v for k, v in sorted(found.items()) if k.startswith(LABEL_PREFIX)},
                         size_bytes=path.stat().st_size, python=inside["python"], agent=inside["agent"],
                         environment_sha256=imageenv.identity(env), environment=env)


NOT_BUILT = "not built yet"  # an ImageIdentity's sha256 in a plan made before its image exists (--dry-run)


def unbuilt(reference: str) -> ImageIdentity | None:
    """For `rkit run --dry-run` of a recipe whose image flavor is not built yet: the identity it will have where the
    build puts it (`make image FLAVOR=...`), its digest NOT_BUILT, the Python and agent of rkit's own images. None
    for anything else (a SIF path that is not there is a mistake, not a plan)."""
    if reference not in FLAVORS:
        return None
    return ImageIdentity(reference=reference, path=str(_current_plan(reference).sif), sha256=NOT_BUILT,
                         flavor=reference)


def resolve(reference: str) -> ImageIdentity | None:
    path = locate(reference)
    return None if path is None else identify(reference, path)

"""An image's environment identity (imageenv): what changes it, what does not, and how a change is named."""

from __future__ import annotations

import pytest

from rkit.contract.errors import RkitError
from rkit.images import env as imageenv
from rkit.images.identity import ImageIdentity

LABELS = {"org.rkit.definition.sha256": "sha256:def", "org.rkit.lock.sha256": "sha256:lock",
          "org.rkit.build.date": "2026-12-01T08:00:00Z"}
FOUND = {"python_version": "3.13.5", "packages": {"numpy": "2.5.5", "rkit": "0.1.0"},
         "debian": {"python3": "3.13.5-1", "libc6": "2.41-12"}}


def test_the_identity_covers_packages_and_build_inputs_not_the_build_date():
    env = imageenv.environment(FOUND, LABELS)
    same = imageenv.environment(FOUND, {**LABELS, "org.rkit.build.date": "2026-12-02T09:00:00Z"})
    assert imageenv.identity(env) == imageenv.identity(same)
    other = imageenv.environment({**FOUND, "packages": {"numpy": "2.5.4", "rkit": "0.1.0"}}, LABELS)
    assert imageenv.identity(other) != imageenv.identity(env)
    relocked = imageenv.environment(FOUND, {**LABELS, "org.rkit.lock.sha256": "sha256:other"})
    assert imageenv.identity(relocked) != imageenv.identity(env)


def test_changes_are_grouped_and_named():
    a = imageenv.environment(FOUND, LABELS)
    b = imageenv.environment({**FOUND, "packages": {"numpy": "2.5.4"},
                              "debian": {**FOUND["debian"], "curl": "8.14.1-2"}}, LABELS)
    diff = imageenv.changes(a, b)
    assert diff == {"python": [{"key": "numpy", "a": "2.5.5", "b": "2.5.4"}, {"key": "rkit", "a": "0.1.0", "b": None}],
                    "debian": [{"key": "curl", "a": None, "b": "8.14.1-2"}]}
    assert imageenv.describe(diff) == ("python: numpy 2.5.5 -> 2.5.4, rkit 0.1.0 -> (none); "
                                       "debian: curl (none) -> 8.14.1-2")
    assert imageenv.changes(a, a) == {} and imageenv.describe({}) == "nothing"


def test_same_environment_accepts_a_rebuild_and_refuses_a_change_naming_it():
    env = imageenv.environment(FOUND, LABELS)
    stamped = ImageIdentity(reference="x.sif", path="/i/x.sif", sha256="sha256:aaa", flavor="cpu",
                            environment_sha256=imageenv.identity(env), environment=env)
    rebuild = ImageIdentity(reference="x.sif", path="/i/x.sif", sha256="sha256:bbb", flavor="cpu",
                            environment_sha256=imageenv.identity(env), environment=env)
    assert stamped.same_environment(rebuild) is rebuild
    changed_env = imageenv.environment({**FOUND, "packages": {"numpy": "2.5.5"}}, LABELS)
    changed = ImageIdentity(reference="x.sif", path="/i/x.sif", sha256="sha256:ccc", flavor="cpu",
                            environment_sha256=imageenv.identity(changed_env), environment=changed_env)
    with pytest.raises(RkitError, match=r"image digest mismatch: expected sha256:aaa, found sha256:ccc, and it holds "
                                        r"another environment: python: rkit 0.1.0 -> \(none\)"):
        stamped.same_environment(changed)
    old = ImageIdentity(reference="x.sif", path="/i/x.sif", sha256="sha256:aaa", flavor="cpu")  # stamped earlier
    with pytest.raises(RkitError, match="recorded no environment"):
        old.same_environment(rebuild)

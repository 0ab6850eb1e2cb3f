"""trainer.overrides against MaxText's own config, before anything starts (maxtext_keys.py)."""

from __future__ import annotations

import pytest

from rkit.contract.errors import RecipeError
from rkit.recipe import maxtext_keys
from rkit.recipe.load import load_recipe, parse_recipe

from ..conftest import REPO, TINY, rkit

KEYS = {"learning_rate": ["number"], "steps": ["integer"], "enable_dropout": ["boolean"],
        "dataset_type": {"enum": ["synthetic", "hf"], "null": False}, "run_name": ["string"],
        "tokenizer_path": ["string", "null"], "logical_axis_rules": None}


def test_an_unknown_key_names_the_closest_known_ones():
    [p] = maxtext_keys.problems({"learning_rat": 1e-4}, KEYS, "MaxText 0.2.5")
    assert p.path == "trainer.overrides.learning_rat"
    assert "no key 'learning_rat' (MaxText 0.2.5)" in p.message and "Did you mean 'learning_rate'?" in p.message
    [far] = maxtext_keys.problems({"zzzz": 1}, KEYS, "here")
    assert "Did you mean" not in far.message


@pytest.mark.parametrize("key,value", [("learning_rate", "abc"), ("learning_rate", [1]), ("steps", 2.5),
                                       ("steps", "ten"), ("enable_dropout", "maybe"), ("dataset_type", "tf"),
                                       ("run_name", {"a": 1})])
def test_a_value_of_the_wrong_simple_type_is_refused(key, value):
    [p] = maxtext_keys.problems({key: value}, KEYS, "here")
    assert p.path == f"trainer.overrides.{key}" and "which MaxText's config declares for it" in p.message


@pytest.mark.parametrize("key,value", [("learning_rate", "1e-4"), ("learning_rate", 3), ("steps", "10"),
                                       ("steps", 4.0), ("enable_dropout", "false"), ("enable_dropout", True),
                                       ("dataset_type", "hf"), ("tokenizer_path", "none"), ("run_name", 12),
                                       ("logical_axis_rules", [["a", "b"]])])
def test_values_maxtext_takes_from_its_command_line_pass(key, value):
    # MaxText parses each key=value, then pydantic coerces in lax mode: "1e-4" is a number, "10" an integer.
    assert maxtext_keys.problems({key: value}, KEYS, "here") == []


def test_every_shipped_recipe_passes_the_host_maxtext():
    found = maxtext_keys.host_keys()
    assert len(found["keys"]) > 500 and found["keys"]["learning_rate"] == ["number"]
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        overrides = load_recipe(path).config.trainer.overrides or {}
        assert maxtext_keys.problems(overrides, found["keys"], "host") == [], path


def test_a_misspelled_key_in_the_recipe_file_is_named_at_its_line():
    text = TINY.read_text().replace("    vocab_size: 256\n", "    vocab_sise: 256\n")
    line = text.splitlines().index("    vocab_sise: 256") + 1
    recipe = parse_recipe("mine.yaml", text)
    with pytest.raises(RecipeError) as err:
        maxtext_keys.check(recipe, None)
    assert f"mine.yaml:{line}: trainer.overrides.vocab_sise: MaxText has no key 'vocab_sise'" in str(err.value)
    assert "Did you mean 'vocab_size'?" in str(err.value)


def test_validate_and_dry_run_refuse_a_misspelled_override_before_anything_starts(tmp_path):
    maxtext_keys.host_keys()  # the first read of MaxText's config (imports, 3 s) is memoised
    for command in (["validate"], ["run", "--dry-run"]):
        done = rkit(*command, str(TINY), "-o", f"runs_dir={tmp_path}", "-o", "trainer.overrides.learning_rat=1e-4",
                    cwd=tmp_path, check=2)
        assert "trainer.overrides.learning_rat: MaxText has no key 'learning_rat'" in done.stderr
        assert "Did you mean 'learning_rate'?" in done.stderr
        assert "(from -o trainer.overrides.learning_rat=1e-4)" in done.stderr and "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())  # nothing was created: no run directory, no attempt, no rank started


def test_a_gpu_recipe_is_checked_against_the_hosts_maxtext_when_it_is_the_version_its_image_locks(tmp_path):
    """No rocm image here (an empty image cache): validate and --dry-run still name a misspelt key, asking the
    host's MaxText because it is the version containers/lock/rocm.txt pins, and say so; a host of another version
    is not asked, and a note says why the keys were not checked."""
    from rkit.images.store import locked_version

    recipe = REPO / "recipes" / "gpu" / "llama3-8b-mi300x.yaml"
    env = {"RKIT_IMAGE_CACHE": str(tmp_path / "empty cache"), "RKIT_APPTAINER": "true"}
    extra = ("-o", "trainer.overrides.dataset_type=synthetic", "-o", f"runs_dir={tmp_path / 'runs'}")
    assert locked_version("rocm", "maxtext") == maxtext_keys.host_keys()["maxtext"] == "0.2.5"
    for command in (["validate"], ["run", "--dry-run"]):
        done = rkit(*command, str(recipe), *extra, "-o", "trainer.overrides.learning_rat=1", cwd=tmp_path, env=env,
                    check=2)
        assert "trainer.overrides.learning_rat: MaxText has no key 'learning_rat' (MaxText 0.2.5 of " in done.stderr
        assert "the version the image locks). Did you mean 'learning_rate'?" in done.stderr
    done = rkit("validate", str(recipe), *extra, cwd=tmp_path, env=env, check=0)
    assert "note: trainer.overrides checked against MaxText 0.2.5 of" in done.stderr
    assert "no rocm image built" in done.stderr and not (tmp_path / "runs").exists()
    other = maxtext_keys.check(load_recipe(recipe, ["trainer.overrides.dataset_type=synthetic",
                                                    "trainer.overrides.learning_rat=1"]), None, locked="9.9.9")
    assert other is not None and "this host's MaxText is 0.2.5, not the 9.9.9 the image locks" in other


def test_an_o_mistake_is_named_at_the_option_not_at_a_recipe_line():
    done = rkit("validate", str(TINY), "-o", "checkpoint.period=abc", check=2)
    # No line: the recipe's own line for the key says `period: 10`, not what was refused.
    assert f"  {TINY}: checkpoint.period: 'abc' is not a period; expected an integer (steps), auto (chosen from " \
        "the measured save cost and failure rate) or a time such as 90s, 10m or 1.5h. (from -o " \
        "checkpoint.period=abc)" in done.stderr


def test_the_already_exists_hint_repeats_the_users_own_options(tmp_path):
    (tmp_path / "tiny-cpu").mkdir()
    (tmp_path / "tiny-cpu" / "resolved.json").write_text("{}")
    done = rkit("run", str(TINY), "-o", f"runs_dir={tmp_path}", "-o", "trainer.steps=7", cwd=tmp_path, check=2)
    assert f"rkit run {TINY} -o runs_dir={tmp_path} -o trainer.steps=7 --resume" in done.stderr
    assert f"rkit run {TINY} -o runs_dir={tmp_path} -o trainer.steps=7 -o name=NEW" in done.stderr


def test_the_learning_rate_schedule_follows_steps_unless_it_is_fixed():
    base = load_recipe(TINY, ["trainer.steps=30"]).resolved
    longer = load_recipe(TINY, ["trainer.steps=40"]).resolved
    assert maxtext_keys.schedule_steps(base) == 30
    why = maxtext_keys.schedule_change(base, longer)
    assert why.startswith("learning-rate schedule differs: 30 vs 40 steps")
    fixed = ["trainer.overrides.learning_rate_schedule_steps=40"]
    assert maxtext_keys.schedule_change(load_recipe(TINY, ["trainer.steps=30", *fixed]).resolved,
                                        load_recipe(TINY, ["trainer.steps=40", *fixed]).resolved) is None
    assert maxtext_keys.schedule_change(base, load_recipe(TINY, ["trainer.steps=30", "name=x"]).resolved) is None
    assert maxtext_keys.schedule_change({}, base) is None


def test_base_config_is_a_yaml_mapping_file_or_a_config_maxtext_ships(tmp_path):
    shipped = ["base.yml", "models/llama2-7b.yml"]
    mine = tmp_path / "mine.yml"
    mine.write_text("steps: 5\n")
    assert maxtext_keys.base_config_problem(str(mine), shipped, "MaxText") is None
    assert maxtext_keys.base_config_problem("models/llama2-7b.yml", shipped, "MaxText") is None
    os_fifo = tmp_path / "fifo"
    import os

    os.mkfifo(os_fifo)
    (tmp_path / "list.yml").write_text("- a\n- b\n")
    refused = {"/dev/zero": "not a regular file", str(tmp_path): "not a regular file",
               str(os_fifo): "not a regular file", str(tmp_path / "none.yml"): "No such file",
               str(tmp_path / "list.yml"): "not a MaxText config", "bse.yml": "Did you mean 'base.yml'?",
               "/etc/passwd": "not a MaxText config"}
    for name, says in refused.items():
        why = maxtext_keys.base_config_problem(name, shipped, "MaxText")
        assert why is not None and says in why, (name, why)

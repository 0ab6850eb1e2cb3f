from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rkit.contract.errors import RecipeError, RkitError
from rkit.contract.rundir import RunDir
from rkit.recipe.load import IDENTITY_KEYS, config_hash, load_recipe, parse_override_value, parse_recipe

from ..conftest import REPO, TINY


def test_every_shipped_recipe_is_valid():
    recipes = sorted((REPO / "recipes").glob("*.yaml"))
    assert TINY in recipes
    for path in recipes:
        assert load_recipe(path).config_hash.startswith("sha256:")


def test_hash_ignores_key_order_comments_and_quoting():
    base = load_recipe(TINY)
    data = yaml.safe_load(TINY.read_text())
    reordered = {k: data[k] for k in reversed(list(data))}
    reordered["trainer"] = {k: data["trainer"][k] for k in reversed(list(data["trainer"]))}
    text = "# a comment\n" + yaml.safe_dump(reordered, sort_keys=False, default_style=None)
    text = text.replace("kind: maxtext", "kind: \"maxtext\"  # quoted").replace("hardware: cpu", "hardware: 'cpu'")
    other = parse_recipe("reordered.yaml", text)
    assert other.config_hash == base.config_hash


def test_hash_excludes_only_identity():
    base = load_recipe(TINY)
    renamed = load_recipe(TINY, ["name=another", "runs_dir=/elsewhere", "access=group"])
    assert renamed.config_hash == base.config_hash
    assert set(IDENTITY_KEYS) == {"name", "runs_dir", "access"}


def _leaves(value, prefix=()):
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            yield from _leaves(sub, prefix + (key,))
    else:
        yield prefix, value


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if value is None:
        return 1
    if isinstance(value, dict):
        return {"EXTRA": "1"}
    return f"{value}x"


def _operational(path: tuple) -> bool:
    from rkit.contract.stamp import OPERATIONAL_KEYS

    return path[0] in OPERATIONAL_KEYS or ".".join(path[:2]) in OPERATIONAL_KEYS


def test_hash_changes_with_every_value_that_can_change_training():
    base = load_recipe(TINY)
    for path, value in _leaves(base.resolved):
        if path[0] in IDENTITY_KEYS or _operational(path):
            continue
        changed = copy.deepcopy(base.resolved)
        target = changed
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = _changed(value)
        assert config_hash(changed) != base.config_hash, path


def test_operational_knobs_are_out_of_the_hash():
    """What keeps the run going and watches it (budgets, timeouts, observability, Slurm's time and queue) is not
    what it trains: --resume accepts changes to them."""
    base = load_recipe(TINY)
    leaves = [path for path, _ in _leaves(base.resolved) if _operational(path)]
    assert {p[0] for p in leaves} == {"resilience", "observability", "slurm"} and len(leaves) > 15
    for path, value in _leaves(base.resolved):
        if not _operational(path):
            continue
        changed = copy.deepcopy(base.resolved)
        target = changed
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = _changed(value)
        assert config_hash(changed) == base.config_hash, path
    assert load_recipe(TINY, ["slurm.gpus_per_node=8"]).config_hash != base.config_hash  # the process layout


@pytest.mark.parametrize("key", ["base_emb_dim", "vocab_size", "per_device_batch_size", "dataset_type"])
def test_hash_changes_with_each_trainer_override(key):
    base = load_recipe(TINY)
    value = base.resolved["trainer"]["overrides"][key]
    new = value + 1 if isinstance(value, int) else "tfds"
    assert load_recipe(TINY, [f"trainer.overrides.{key}={new}"]).config_hash != base.config_hash


def test_overrides_are_typed_and_applied_before_validation():
    r = load_recipe(TINY, ["trainer.steps=20", "trainer.overrides.learning_rate=1e-3", "checkpoint.async=false",
                           "trainer.overrides.new_key=hello world"])
    assert r.resolved["trainer"]["steps"] == 20
    assert r.resolved["trainer"]["overrides"]["learning_rate"] == 0.001
    assert r.resolved["checkpoint"]["async"] is False
    assert r.resolved["trainer"]["overrides"]["new_key"] == "hello world"
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, ["trainer.steps=many"])
    assert "trainer.steps" in str(err.value) and "(from -o)" not in str(err.value)
    with pytest.raises(RecipeError, match="not key.path=value"):
        load_recipe(TINY, ["trainer.steps"])


@pytest.mark.parametrize("raw,expected", [("20", 20), ("1e-3", 0.001), ("true", True), ("null", None),
                                          ("abc", "abc"), ("[1, 2]", [1, 2]), ("", ""), ("[1, 2", "[1, 2"),
                                          ('["--mem=0"]', ["--mem=0"]), ("{a: 1, b: [x]}", {"a": 1, "b": ["x"]})])
def test_parse_override_value(raw, expected):
    assert parse_override_value(raw) == expected


@pytest.mark.parametrize("raw,words", [("&a [1, *a]", "aliases"), ("{a: 1, a: 2}", "duplicate key"),
                                       ("[" * 40 + "]" * 40, "nests more than 32"), ("[2024-13-45]", "timestamp")])
def test_an_override_value_has_the_files_limits(raw, words):
    with pytest.raises(ValueError, match=words):
        parse_override_value(raw)


def test_a_list_override_is_a_list_for_rkit_and_for_maxtext(tmp_path):
    from rkit.runtime.trainers.maxtext import maxtext_overrides

    r = load_recipe(TINY, ['slurm.extra_sbatch=["--mem=0", "--comment=x"]',
                           "trainer.overrides.data_sharding=[[fsdp, tensor]]"])
    assert r.config.slurm.extra_sbatch == ("--mem=0", "--comment=x")
    argv = maxtext_overrides(r.config, RunDir(tmp_path / "run"), str(tmp_path / "cache"))
    assert 'data_sharding=[["fsdp", "tensor"]]' in argv  # a list on MaxText's command line, not the text "[...]"
    with pytest.raises(RecipeError, match=r"slurm\.extra_sbatch"):
        load_recipe(TINY, ["slurm.extra_sbatch={a: 1}"])  # a mapping where the schema wants a list: the file's check
    command = load_recipe(TINY, ["trainer.steps=20"]).command("--resume", absolute=True)
    assert command == f"rkit run {TINY.resolve()} -o trainer.steps=20 --resume"
    with pytest.raises(RecipeError, match=r"trainer\.steps: 100\.0 is a number; expected integer"):
        load_recipe(TINY, ["trainer.steps=1e2"])  # refused by the schema, as `run` refuses it, not noted as valid
    with pytest.raises(RecipeError, match="override key path of 1500 levels"):
        load_recipe(TINY, [".".join(["env"] * 1500) + "=1"])


def test_defaults_are_applied_from_the_schema():
    r = parse_recipe("min.yaml", "name: m\ntrainer: {kind: maxtext, steps: 3}\n")
    assert r.resolved["checkpoint"] == {"period": 100, "keep": 3, "async": True}
    assert r.resolved["resources"] == {"nodes": 1, "processes_per_node": 1}
    assert r.resolved["image"] == "none" and r.resolved["runs_dir"] == "runs"


def _problems(text: str, overrides=()) -> list:
    with pytest.raises(RecipeError) as err:
        parse_recipe("bad.yaml", text, overrides)
    return err.value.problems


def test_every_problem_is_reported_at_once_with_key_and_line():
    text = ("name: ok\n"
            "trainer:\n"
            "  kind: maxtext\n"
            "  steps: ten\n"
            "  overides: {}\n"
            "resources:\n"
            "  processes_per_node: 0\n"
            "checkpoint:\n"
            "  async: maybe\n")
    problems = {p.path: p for p in _problems(text)}
    assert problems["trainer.steps"].line == 4 and "expected integer" in problems["trainer.steps"].message
    assert problems["trainer.overides"].line == 5 and "Did you mean 'overrides'" in problems["trainer.overides"].message
    assert problems["resources.processes_per_node"].line == 7
    assert problems["checkpoint.async"].line == 9


def test_missing_sections_and_duplicates_and_aliases():
    assert [p.path for p in _problems("name: x\n")] == ["trainer"]
    dup = _problems("name: x\nname: y\ntrainer: {kind: maxtext, steps: 1}\n")
    assert dup[0].path == "name" and dup[0].line == 2 and "duplicate" in dup[0].message
    alias = _problems("name: &n x\nother: *n\n")
    assert "aliases" in alias[0].message and alias[0].line == 2


def test_owned_maxtext_keys_and_secrets_are_refused():
    text = TINY.read_text()
    problems = _problems(text, ["trainer.overrides.run_name=x", "env.HF_TOKEN=abc"])
    messages = {p.path: p.message for p in problems}
    assert "name" in messages["trainer.overrides.run_name"]
    assert "secret" in messages["env.HF_TOKEN"]


@pytest.mark.parametrize("text,words", [
    ("", "empty"),
    ("   \n# only a comment\n", "empty"),
    ("- a\n- b\n", "mapping"),
    ("name: [unclosed\n", "malformed YAML"),
    ("name: x\n\ttrainer: 1\n", "malformed YAML"),
    ("name: 2024-01-01\ntrainer: {kind: maxtext, steps: 1}\n", "date"),
    ("name: x\ntrainer: {kind: maxtext, steps: .nan}\n", "finite"),
    ("1: x\n", "string"),
])
def test_bad_text_gets_a_clear_problem(text, words):
    problems = _problems(text)
    assert any(words.lower() in p.render("bad.yaml").lower() for p in problems), [p.render("b") for p in problems]


def test_binary_and_huge_files(tmp_path: Path):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\x7fELF\x00\x01\x02" * 100)
    with pytest.raises(RecipeError, match="binary"):
        load_recipe(binary)
    huge = tmp_path / "huge.yaml"
    huge.write_text("name: x\n" + "# padding\n" * 1_100_000)
    with pytest.raises(RecipeError, match="MB"):
        load_recipe(huge)
    with pytest.raises(RkitError, match="no such recipe"):
        load_recipe(tmp_path / "missing.yaml")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(RecipeError, match="UTF-8"):
        load_recipe(latin)


def test_the_typed_view_reads_every_section_of_every_shipped_recipe():
    from rkit.contract.config import Config

    for path in sorted((REPO / "recipes").glob("*.yaml")):
        recipe = load_recipe(path)
        config = recipe.config
        assert config.trainer.steps == recipe.resolved["trainer"]["steps"] and config.trainer.final_step == \
            recipe.resolved["trainer"]["steps"] - 1
        assert config.checkpoint.asynchronous is recipe.resolved["checkpoint"]["async"]
        assert config.processes == recipe.processes and config.slurm.extra_sbatch == \
            tuple(recipe.resolved["slurm"]["extra_sbatch"])
        assert config.observability.prometheus.port == recipe.resolved["observability"]["prometheus"]["port"]
    # A run stamped before a section existed: the schema's defaults fill it in.
    old = {k: v for k, v in load_recipe(TINY).resolved.items() if k not in ("observability", "slurm")}
    config = Config.from_resolved(old)
    assert config.observability.straggler_factor == 1.5 and config.slurm.container_launch


@pytest.mark.parametrize("override,says", [
    ("trainer.overrides.dataset_path=gs://u:hunter2@bucket/x", "holds a credential"),
    ('trainer.overrides.data_sharding=[["${x}"]]', "an interpolation"),
    ('trainer.overrides.extra={"a": ["https://bob:pw@host/x"]}', "holds a credential"),
])
def test_credentials_and_interpolations_are_refused_at_any_depth_of_an_override(override, says):
    with pytest.raises(RecipeError) as err:
        load_recipe(TINY, [override])
    assert says in str(err.value) and "hunter2" not in str(err.value) and ":pw@" not in str(err.value)


def test_a_run_started_when_keep_defaulted_to_null_resumes_with_the_new_default(tmp_path):
    # checkpoint.keep is retention, not training (issue 39 changed its default from null to 3): --resume accepts
    # it as a recorded change; a change to what is trained is still refused.
    import json

    from rkit.contract.errors import RkitError
    from rkit.contract.rundir import RunDir
    from rkit.run.plan import check_resume

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.resolved.write_text(json.dumps(load_recipe(TINY, ["checkpoint.keep=null"]).resolved))
    run.manifest.write_text(json.dumps({"config_hash": "sha256:" + "ab" * 32}))
    assert check_resume(run, load_recipe(TINY), None)["checkpoint.keep"] == [None, 3]
    with pytest.raises(RkitError, match="changed: trainer.overrides"):
        check_resume(run, load_recipe(TINY, ["trainer.overrides.base_emb_dim=128"]), None)

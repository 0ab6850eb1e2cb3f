"""Real data, checked and fingerprinted (issue 37): a recipe's data settings are checked before anything starts
(files, tokenizer and its vocabulary, the columns in the first record: exit 2 naming the key and the fix), and each
step's batch fingerprint is a sum over sequences, so that `rkit compare` can say whether two runs consumed the same
tokens at the same steps on any number of processes."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import pytest

from rkit.contract.errors import RecipeError
from rkit.readers import compare, outcome
from rkit.recipe import datacheck, sampledata
from rkit.recipe.load import load_recipe, placed, recipe_lines
from rkit.runtime.telemetry import metrics

from ..conftest import REPO, rkit

GRAIN = REPO / "recipes" / "tiny-grain.yaml"
needs_stack = pytest.mark.skipif(importlib.util.find_spec("array_record") is None
                                 or importlib.util.find_spec("maxtext") is None,
                                 reason="the training stack (array_record, MaxText) is not in this Python")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    if importlib.util.find_spec("array_record") is None or importlib.util.find_spec("maxtext") is None:
        pytest.skip("the training stack (array_record, MaxText) is not in this Python")
    path = tmp_path_factory.mktemp("data") / "tiny text"
    sampledata.make(path, documents_per_file=20)
    return path


def problems(*overrides: str) -> list[str]:
    """The data settings' problems as `rkit validate` and `run` print them (run/plan.refuse_together), each placed
    on the recipe's line or the -o option that set it."""
    try:
        recipe = load_recipe(GRAIN, list(overrides))
    except RecipeError as exc:  # the recipe's own rules (a shrink with grain's settings)
        return [f"{p.path}: {p.message}" for p in exc.problems]
    found = placed(datacheck.problems(recipe.config, recipe.config.launcher), recipe_lines(recipe), recipe.overrides)
    return [f"{p.path}: {p.message}" for p in found]


def with_files(data: Path, kind: str = "array_record") -> str:
    return f"trainer.overrides.grain_train_files={data}/train-*.{kind}"


@needs_stack
def test_the_sample_data_is_the_same_bytes_every_time_and_reads_back(tmp_path, data):
    again = sampledata.make(tmp_path, documents_per_file=20)
    assert [p.read_bytes() for p in again] == [(data / p.name).read_bytes() for p in again]
    from maxtext.input_pipeline.protos import example_pb2

    from rkit.recipe.datacheck import first_record

    for kind in ("arrayrecord", "tfrecord"):
        example = example_pb2.Example()
        example.ParseFromString(first_record(data / f"train-00000.{kind.replace('arrayrecord', 'array_record')}",
                                             kind))
        assert example.features.feature["text"].bytes_list.value[0].startswith(b"Document 0. ")
    assert sampledata.masked_crc32c(b"") == 0xA282EAD8  # TFRecord's masked CRC-32C of nothing


@needs_stack
def test_the_shipped_recipe_on_good_data_is_valid(data):
    assert problems(with_files(data)) == []
    assert problems(with_files(data, "tfrecord"), "trainer.overrides.grain_file_type=tfrecord") == []


@needs_stack
def test_data_files_that_are_not_there_or_not_files_are_named(data, tmp_path):
    assert problems(f"trainer.overrides.grain_train_files={tmp_path}/none-*.array_record") == [
        f"trainer.overrides.grain_train_files: '{tmp_path}/none-*.array_record' matches no file (looked from "
        f"{os.getcwd()}); give a glob of your data files, or make the sample set with `make data` (docs/data.md). "
        f"(from -o trainer.overrides.grain_train_files={tmp_path}/none-*.array_record)"]
    os.mkfifo(tmp_path / "pipe.array_record")  # named, never opened: no hang
    found = problems(f"trainer.overrides.grain_train_files={tmp_path}/pipe.array_record")
    assert len(found) == 1 and "is not a regular file; match the data files themselves" in found[0]
    found = problems(f"trainer.overrides.grain_train_files={data}")
    assert len(found) == 1 and "is a directory" in found[0]
    found = problems("trainer.overrides.grain_train_files=")
    assert len(found) == 1 and found[0].startswith("trainer.overrides.grain_train_files: is empty")


@needs_stack
def test_a_relative_data_path_on_slurm_is_refused(data):
    found = problems("launcher=slurm", "trainer.overrides.grain_train_files=data/tiny-text/*.array_record")
    assert any("is relative: on Slurm the ranks start in the run directory" in f for f in found)


@needs_stack
def test_the_tokenizer_must_exist_and_fit_the_vocabulary(data, tmp_path):
    found = problems(with_files(data), "trainer.overrides.tokenizer_path=tokenizer.nope")
    assert found == ["trainer.overrides.tokenizer_path: 'tokenizer.nope' is neither a file nor a tokenizer shipped "
                     "with MaxText; give the path of your tokenizer model (on a shared file system) or a name from "
                     "MaxText's assets/tokenizers. (from -o trainer.overrides.tokenizer_path=tokenizer.nope)"]
    found = problems(with_files(data), "trainer.overrides.vocab_size=32000")
    assert found == ["trainer.overrides.vocab_size: 32000 is smaller than the tokenizer's vocabulary (32768 pieces "
                     "in tokenizer.default): token ids up to 32767 would index past the embedding; set vocab_size "
                     "to 32768 or more. (from -o trainer.overrides.vocab_size=32000)"]
    (tmp_path / "junk.model").write_bytes(b"not a model")
    found = problems(with_files(data), f"trainer.overrides.tokenizer_path={tmp_path}/junk.model")
    assert len(found) == 1 and "is not a sentencepiece model" in found[0]


@needs_stack
def test_a_column_missing_from_the_first_record_is_named_with_the_ones_there(data):
    found = problems(with_files(data), "trainer.overrides.train_data_columns=[body]")
    assert found == [f"trainer.overrides.train_data_columns: 'body' not in the first record of "
                     f"'{data}/train-00000.array_record', which has text feature(s); set train_data_columns to the "
                     "column with the text. (from -o trainer.overrides.train_data_columns=[body])"]


@needs_stack
def test_rkit_validate_exits_2_and_writes_nothing(data, tmp_path):
    done = rkit("validate", str(GRAIN), "-o", "trainer.overrides.vocab_size=100", "-o", with_files(data),
                cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "trainer.overrides.vocab_size: 100 is smaller than the tokenizer's vocabulary" in done.stderr
    done = rkit("run", str(GRAIN), "-o", "trainer.overrides.vocab_size=100", "-o", with_files(data), cwd=tmp_path)
    assert done.returncode == 2 and not (tmp_path / "runs").exists()


@needs_stack
def test_three_kinds_of_problem_in_one_file_are_reported_in_one_go(data, tmp_path):
    """The schema's (a step count that is not an integer), the data settings' (a tokenizer that is not there) and
    MaxText's keys' (a misspelt key): `validate` and `run --dry-run` name all three at once, exit 2, write nothing."""
    text = GRAIN.read_text().replace("  steps: 100\n", "  steps: 100.0\n")
    assert "steps: 100.0" in text
    recipe = tmp_path / "three.yaml"
    recipe.write_text(text.replace("  overrides:\n", "  overrides:\n    learning_rat: 0.001\n", 1))
    extra = ("-o", with_files(data), "-o", "trainer.overrides.tokenizer_path=/nowhere/tokenizer.model")
    for argv in (("validate", str(recipe)), ("run", str(recipe), "--dry-run")):
        done = rkit(*argv, *extra, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "3 problem(s) in the recipe" in done.stderr, done.stderr
        assert "trainer.steps: 100.0 is a number; expected integer" in done.stderr
        assert "trainer.overrides.tokenizer_path: '/nowhere/tokenizer.model' is neither a file" in done.stderr
        assert "trainer.overrides.learning_rat: MaxText has no key 'learning_rat'" in done.stderr
        assert "Did you mean 'learning_rate'" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_synthetic_data_is_not_checked_as_files():
    assert problems("trainer.overrides.dataset_type=synthetic", "trainer.overrides.grain_train_files=/nowhere") == []


def test_a_batch_fingerprint_does_not_depend_on_which_process_read_which_sequence():
    batch = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
    whole, rows = metrics.batch_fingerprint(batch)
    assert rows == 4 and len(whole) == 16
    halves = [metrics.batch_fingerprint(batch[:2]), metrics.batch_fingerprint(batch[2:][::-1])]
    lines = [[{"step": 5, "attempt": 1, "rank": r, "data_fingerprint": fp}] for r, (fp, _) in enumerate(halves)]
    assert metrics.step_fingerprints(lines) == {5: whole}  # 2 processes' halves sum to 1 process's whole
    other = batch.copy()
    other[3, 7] += 1  # one token
    assert metrics.batch_fingerprint(other)[0] != whole


def test_the_newest_attempt_that_trained_a_step_gives_its_fingerprint():
    lines = [[{"step": 3, "attempt": 1, "rank": 0, "data_fingerprint": "0" * 15 + "1"},
              {"step": 3, "attempt": 2, "rank": 0, "data_fingerprint": "0" * 15 + "2"},
              {"step": 4, "attempt": 2, "rank": 0, "data_fingerprint": "0" * 15 + "3"}],
             [{"step": 3, "attempt": 2, "rank": 1, "data_fingerprint": "f" * 16},
              {"step": 4, "attempt": 2, "rank": 1, "data_fingerprint": None}]]
    assert metrics.step_fingerprints(lines) == {3: "0" * 15 + "1"}  # (2 + 2**64 - 1) mod 2**64; 4: rank 1 has none


def record(data: dict[int, str] | None) -> dict:
    return {"version": 1, "run": "r", "state": "finished", "config_hash": "c", "image_sha256": None,
            "loss": {"per_step": {str(s): 1.0 for s in range(3)}, "sha256": None},
            "data": None if data is None else {"per_step": {str(s): fp for s, fp in data.items()}, "count": len(data)},
            "step_time": outcome.summary([0.1, 0.1]), "tokens_per_sec_per_device": outcome.summary([1.0, 1.0]),
            "host_rss_bytes": outcome.summary([1, 1]), "device_memory_peak_bytes": None}


def test_compare_says_same_data_or_names_the_first_step_whose_batch_differs():
    a = record({0: "a" * 16, 1: "b" * 16, 2: "c" * 16})
    same = compare.compare(a, record({0: "a" * 16, 1: "b" * 16, 2: "c" * 16}))
    assert same["agree"] and "same data: EXACT over 3 steps" in compare.render(same)
    moved = compare.compare(a, record({0: "a" * 16, 1: "c" * 16, 2: "b" * 16}))
    assert not moved["agree"] and moved["data"]["first_difference"]["step"] == 1
    text = compare.render(moved)
    assert f"same data: DIFFERENT at 2 of 3 steps; first at step 1 (A {'b' * 16} B {'c' * 16})" in text
    assert "verdict: DIFFERENT (the data differs)" in text
    unknown = compare.compare(a, record(None))
    assert unknown["agree"] and "same data: not recorded for both runs" in compare.render(unknown)
    assert outcome.shape_problem(record({0: "nothex-nothex-no"})) == (
        "data.per_step is not a mapping of step to a 16-digit fingerprint")


def test_a_shrink_with_grain_needs_its_elastic_iterator_and_no_packing(data):
    shrink = ["launcher=local", "resources.nodes=2", "resources.processes_per_node=1", "resources.min_nodes=1",
              with_files(data)]
    found = problems(*shrink)
    assert [f.split(":")[0] for f in found] == ["trainer.overrides.grain_use_elastic_iterator",
                                                 "trainer.overrides.packing"]
    assert "per-process iterators cannot be restored on fewer processes" in found[0]
    elastic = [*shrink, "trainer.overrides.grain_use_elastic_iterator=true", "trainer.overrides.packing=false"]
    assert problems(*elastic) == []
    found = problems(*elastic, with_files(data, "tfrecord"), "trainer.overrides.grain_file_type=tfrecord")
    assert [f.split(":")[0] for f in found] == ["trainer.overrides.grain_file_type"]


def test_the_node_local_tier_takes_grain_data(data):
    assert problems(with_files(data), "checkpoint.local_dir=/tmp/rkit-local",
                    "trainer.overrides.ici_data_parallelism=-1", "trainer.overrides.ici_fsdp_parallelism=1") == []

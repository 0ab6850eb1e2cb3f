"""A recipe's data settings checked before anything starts (dataset_type grain): the files its patterns name exist
and are readable regular files, the tokenizer exists and its vocabulary fits the model's, and the columns MaxText
will read are in the first record. A mistake here is one line naming the key and the fix (exit 2, nothing written),
not a rank's traceback minutes into the first attempt.

Checked when a run is planned (`rkit run`, `--dry-run`, `reproduce`) and by `rkit validate`, never when a recipe is
only read (status, report, diff, a unit test's view of a GPU recipe whose data lives on a cluster). Checked on this
host, where the data is where the nodes will see it (a shared file system); remote patterns
(gs://, hf://) and Hugging Face tokenizer names are left to MaxText on the nodes. Reads at most the first record of
the first file and the tokenizer's model: a FIFO or a device in place of a file is named, never opened.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import stat
import struct
from pathlib import Path
from typing import Any

from rkit.contract.config import Config
from rkit.contract.errors import Problem

WHERE = "trainer.overrides."
# base.yml's values of the keys read here (MaxText 0.2.5)
DEFAULTS = {"dataset_type": "synthetic", "grain_file_type": "arrayrecord", "grain_train_files": "",
            "tokenizer_type": "sentencepiece", "tokenizer_path": "", "vocab_size": 32000,
            "train_data_columns": ["text"], "grain_train_mixture_config_path": ""}
REMOTE = ("gs://", "hf://", "s3://", "http://", "https://")
FIRST_RECORD_LIMIT = 64 << 20


def _settings(config: Config) -> dict[str, Any]:
    values = dict(DEFAULTS)
    base = Path(config.trainer.base_config)
    if base.name != "base.yml" and base.is_file():
        try:
            import yaml

            with open(base, encoding="utf-8") as fh:
                found = yaml.safe_load(fh.read(1 << 20))
            values.update({k: v for k, v in (found or {}).items() if k in DEFAULTS})
        except (OSError, ValueError, AttributeError, yaml.YAMLError):
            pass
    values.update({k: v for k, v in (config.trainer.overrides or {}).items() if k in DEFAULTS})
    return values


def problems(config: Config, launcher: str) -> list[Problem]:
    """Why the recipe's data cannot be read as it says; [] for data made on the device (synthetic) and the
    pipelines checked on the nodes (tfds, hf)."""
    s = _settings(config)
    if s["dataset_type"] != "grain":
        return []
    found: list[Problem] = []
    patterns = [p for p in str(s["grain_train_files"] or "").split(";") if p.strip()]
    if not patterns and not s["grain_train_mixture_config_path"]:
        return [Problem(f"{WHERE}grain_train_files", "is empty: dataset_type grain reads the files it names; give "
                                                     "a glob of your data files (make data writes a small set "
                                                     "to data/tiny-text/, see docs/data.md).")]
    first: Path | None = None
    for pattern in patterns:
        pattern = pattern.rsplit(",", 1)[0].strip() if ";" in str(s["grain_train_files"]) else pattern.strip()
        problem, matched = _files_problem(pattern, launcher)
        if problem is not None:
            found.append(Problem(f"{WHERE}grain_train_files", problem))
        elif first is None and matched:
            first = matched[0]
    found.extend(_tokenizer_problems(s, launcher))
    if first is not None and s["grain_file_type"] in ("arrayrecord", "tfrecord"):
        found.extend(_column_problems(s, first))
    return found


def _files_problem(pattern: str, launcher: str) -> tuple[str | None, list[Path]]:
    if pattern.startswith(REMOTE):
        return None, []
    expanded = os.path.expanduser(pattern)
    if launcher == "slurm" and not os.path.isabs(expanded):
        return (f"{pattern!r} is relative: on Slurm the ranks start in the run directory; give the absolute path "
                "of the files on a file system every node mounts."), []
    matched = sorted(Path(p) for p in glob.glob(expanded))
    if not matched:
        return (f"{pattern!r} matches no file (looked from {os.getcwd()}); give a glob of your data files, or "
                "make the sample set with `make data` (docs/data.md)."), []
    for path in matched[:10000]:
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            return f"{str(path)!r} cannot be read: {exc.strerror}; fix its permissions or the pattern.", []
        if not stat.S_ISREG(mode):
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            return f"{str(path)!r} (matched by {pattern!r}) is {what}; match the data files themselves.", []
        if not os.access(path, os.R_OK):
            return f"{str(path)!r} is not readable by this user; fix its permissions.", []
    return None, matched


def maxtext_asset(name: str) -> Path | None:
    """A bare tokenizer name among the installed MaxText's assets (as the agent makes MaxText look for it)."""
    spec = importlib.util.find_spec("maxtext")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        for candidate in (Path(location) / "assets" / "tokenizers" / name, Path(location) / "assets" / name):
            if candidate.is_file():
                return candidate
    return None


def _tokenizer_problems(s: dict[str, Any], launcher: str) -> list[Problem]:
    name, kind = str(s["tokenizer_path"] or ""), str(s["tokenizer_type"])
    key = f"{WHERE}tokenizer_path"
    if kind == "huggingface" or name.startswith(REMOTE):
        return []  # a Hub name or a remote path: MaxText resolves it on the nodes
    if not name:
        return [Problem(key, "is empty: grain data is tokenized on the fly; give the tokenizer's model file (a "
                             "bare name such as tokenizer.default is looked up among MaxText's assets).")]
    path = Path(os.path.expanduser(name))
    if not path.is_file():
        asset = maxtext_asset(name) if os.sep not in name else None
        if asset is None:
            return [Problem(key, f"{name!r} is neither a file nor a tokenizer shipped with MaxText; give the path "
                                 "of your tokenizer model (on a shared file system) or a name from MaxText's "
                                 "assets/tokenizers.")]
        path = asset
    elif launcher == "slurm" and not path.is_absolute():
        return [Problem(key, f"{name!r} is relative: on Slurm the ranks start in the run directory; give its "
                             "absolute path.")]
    if kind != "sentencepiece":
        return []
    try:
        import sentencepiece

        pieces = sentencepiece.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    except ImportError:
        return []
    except (OSError, RuntimeError) as exc:
        return [Problem(key, f"{name!r} is not a sentencepiece model ({str(exc).splitlines()[0][:120]}); give "
                             "the tokenizer's .model file, or set tokenizer_type to the tokenizer's kind.")]
    vocab = s["vocab_size"]
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < pieces:
        return [Problem(f"{WHERE}vocab_size", f"{vocab} is smaller than the tokenizer's vocabulary ({pieces} pieces "
                                              f"in {name}): token ids up to {pieces - 1} would index past the "
                                              f"embedding; set vocab_size to {pieces} or more.")]
    return []


def first_record(path: Path, file_type: str) -> bytes | None:
    """The first record of an ArrayRecord or TFRecord file; None when the file holds none."""
    if file_type == "tfrecord":
        with open(path, "rb") as fh:
            head = fh.read(12)
            if len(head) < 12:
                return None
            (length,) = struct.unpack("<Q", head[:8])
            return fh.read(min(length, FIRST_RECORD_LIMIT))
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    try:
        return reader.read([0])[0] if reader.num_records() else None
    finally:
        reader.close()


def _column_problems(s: dict[str, Any], first: Path) -> list[Problem]:
    columns = s["train_data_columns"]
    if isinstance(columns, str) and columns.startswith("["):  # MaxText reads "[a, b]" given as text as a list
        import yaml

        try:
            columns = yaml.safe_load(columns)
        except yaml.YAMLError:
            pass
    columns = [columns] if isinstance(columns, str) else [str(c) for c in columns or []]
    try:
        record = first_record(first, s["grain_file_type"])
        from maxtext.input_pipeline.protos import example_pb2
    except ImportError:
        return []  # the record readers live in the training environment: MaxText checks on the nodes
    except (OSError, RuntimeError, ValueError) as exc:
        return [Problem(f"{WHERE}grain_train_files", f"{str(first)!r} cannot be read as {s['grain_file_type']} "
                                                     f"({str(exc).splitlines()[0][:120]}); check "
                                                     "grain_file_type and the files.")]
    if record is None:
        return [Problem(f"{WHERE}grain_train_files", f"{str(first)!r} holds no record; match files with data.")]
    example = example_pb2.Example()
    try:
        example.ParseFromString(record)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError and its C implementation's own
        return [Problem(f"{WHERE}grain_train_files", f"the first record of {str(first)!r} is not a tf.train.Example; "
                                                     "MaxText's Grain pipeline reads text records as tf.train.Example "
                                                     "protos (docs/data.md).")]
    present = sorted(example.features.feature.keys())
    aliases = {"text": "messages", "messages": "text"}  # MaxText's ParseFeatures falls back between the two
    missing = [c for c in columns if c not in present and aliases.get(c) not in present]
    if missing:
        return [Problem(f"{WHERE}train_data_columns", f"{', '.join(map(repr, missing))} not in the first record of "
                                                      f"{str(first)!r}, which has {', '.join(present) or 'no'} "
                                                      "feature(s); set train_data_columns to the column with the "
                                                      "text.")]
    return []

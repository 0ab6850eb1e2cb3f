"""Issue 24's corpus of damaged run directories and bad input files, for every command that reads them.

A case folder starts as a copy of the good inputs (build_good): `runs/good` and `runs/damaged`, two copies of one
synthetic run (tests/unit/synthetic_run.py plus attempt records, rank logs, an environment capture and telemetry),
and beside them `good-outcome.json` (that run's outcome.json), `good-bench.json` (a result saved by `rkit bench`)
and `good-manifest.json` (the run's manifest). A Case damages one path of it (`target`, starting from the good file
`source`) and names the commands to run; test_damaged_runs.py runs each command and checks the contract.

Argument placeholders: {case} the case folder, {run} runs/damaged, {good} runs/good, {runs} runs/, {recipe} the
tiny CPU recipe.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..conftest import TINY
from .synthetic_run import T0, write_run

N = 100_000  # nesting depth
RUN = "runs/damaged"
Damage = Callable[[Path, Path], None]  # (the good file it starts from, the path to damage)

# The reader commands of a run directory (the damaged copy beside a good one).
RUN_COMMANDS = {
    "status": ("status", "{run}"),
    "status --json": ("status", "{run}", "--json"),
    "ls": ("ls", "{runs}"),
    "ls --json": ("ls", "{runs}", "--json"),
    "report": ("report", "{run}", "--out", "{case}/report"),
    "diff": ("diff", "{good}", "{run}"),
    "logs": ("logs", "{run}", "--rank", "0"),
    "compare": ("compare", "{good}", "{run}"),
}
ALL = tuple(RUN_COMMANDS)
STATUS = ("status", "status --json")
LS = ("ls", "ls --json")
EVENT_READERS = (*STATUS, *LS, "report", "compare")  # events.jsonl, metrics/
EVENT_FIELD_READERS = (*STATUS, *LS, "compare")
INTERPRETERS = (*STATUS, "report", "compare")  # what must understand resolved.json, not just hold it


@dataclass(frozen=True)
class Case:
    name: str
    target: str  # the path it damages, relative to the case folder ("" when it damages nothing)
    damage: Damage
    commands: tuple[tuple[str, tuple[str, ...]], ...]  # (label, argv with placeholders)
    refuse: frozenset[str] = frozenset()  # labels that must exit 2 (the user must fix the input)
    names: tuple[str, ...] = ()  # an exit 2 names one of these (default: the target's file name)
    source: str = ""  # the good file the damage starts from (default: target)
    ok: bool = False  # a control: every command must exit 0

    @property
    def must_name(self) -> tuple[str, ...]:
        return self.names or (Path(self.target).name,)


# ---------------------------------------------------------------- the good inputs


def build_good(root: Path) -> Path:
    """The good inputs every case folder starts as (see the module's docstring); returns `root`."""
    from rkit.contract.rundir import RunDir
    from rkit.readers import outcome

    from .test_bench import saved_result

    run = write_run(root / "runs" / "good")
    for attempt, nodes in ((1, ["n1", "n2"]), (2, ["n1", "n3"])):
        adir = run / "attempts" / str(attempt)
        adir.mkdir(parents=True)
        (adir / "attempt.json").write_text(json.dumps({
            "attempt": attempt, "started": T0 + 12, "backend": "slurm", "nodes": nodes, "host": "n1",
            "pids": {"0": 100, "1": 101}, "pid_started": {"0": T0, "1": T0}, "resume_from_step": None,
            "ended": T0 + 85, "cause": "hang", "committed_step": 10, "exits": {"0": {"signal": 9}}}))
        for rank in (0, 1):
            (adir / f"rank-{rank}.log").write_text(
                f"rank {rank} attempt {attempt}\nI0101 00:00:00.0 1 x.py:1] [async] Finished save (blocking + "
                "background) in 1.50 seconds\nI0101 00:00:00.0 1 x.py:1] [async] Finished blocking save in 0.25 "
                "seconds\n")
    (run / "attempts" / "2" / "env").mkdir()
    (run / "attempts" / "2" / "env" / "rank-0.json").write_text(json.dumps({
        "python": {"version": "3.12.0", "executable": "/usr/bin/python3"}, "packages": {"jax": "0.4.35"},
        "environment": {"XLA_FLAGS": ""}, "hardware": {"cpu": {"model": "x", "count": 2}, "memory_bytes": 1 << 30},
        "system": {"hostname": "n1", "kernel": "6.1", "os": "Debian"}, "jax": {"backend": "cpu"}}))
    (run / "telemetry").mkdir()
    for node in ("n1", "n2", "n3"):
        (run / "telemetry" / f"{node}.jsonl").write_text("".join(json.dumps(
            {"t": T0 + t, "node": node, "attempt": 2, "cpu_percent": 10.0, "memory": {"used_bytes": 1 << 30}})
            + "\n" for t in (101, 111, 121)))
    stamp = json.loads((run / "manifest.json").read_text())
    env = json.loads((run / "attempts" / "2" / "env" / "rank-0.json").read_text())
    resolved = json.loads((run / "resolved.json").read_text())
    stamp.update(hashed_config={k: v for k, v in resolved.items() if k != "name"}, injections=[],
                 run={"name": "good", "submitted": T0}, host={**env, "git": {"commit": "abc", "dirty": False}})
    (run / "manifest.json").write_text(json.dumps(stamp))
    (root / "good-manifest.json").write_text(json.dumps(stamp))
    shutil.copytree(run, root / RUN, symlinks=True)
    (root / "good-outcome.json").write_text(json.dumps(outcome.compute(RunDir(run))))
    (root / "good-bench.json").write_text(json.dumps(saved_result(root / "bench-rounds", "good", 0.05, seed=1)))
    return root


# ---------------------------------------------------------------- damages


def clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def directory(src: Path, dst: Path) -> None:
    clear(dst)
    dst.mkdir(parents=True)


def fifo(src: Path, dst: Path) -> None:
    """A FIFO no one writes to: an open() for reading waits forever."""
    clear(dst)
    os.mkfifo(dst)


def dev_zero(src: Path, dst: Path) -> None:
    """A link to /dev/zero: endless bytes, no newline."""
    clear(dst)
    dst.symlink_to("/dev/zero")


def content(data: bytes | str) -> Damage:
    def damage(src: Path, dst: Path) -> None:
        clear(dst)
        dst.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
    return damage


def nothing(src: Path, dst: Path) -> None:
    pass


EMPTY = content(b"")
BINARY = content(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 64 + b"\n\xff\xfe\x00{\n")
NESTED_LIST = "[" * N + "]" * N
NESTED_DICT = '{"a":' * N + "1" + "}" * N
BIG = 10 << 20  # a 10 MB line


def appended(*lines: str) -> Damage:
    """The good file with these lines added at its end (after its own last line)."""
    def damage(src: Path, dst: Path) -> None:
        text = src.read_text()
        dst.write_text(text + ("" if text.endswith("\n") else "\n") + "".join(line + "\n" for line in lines))
    return damage


def json_lines(edit: Callable[[int, dict], dict]) -> Damage:
    """Every whole JSON line of the good file through edit(index, object); a line cut short by a crash is kept."""
    def damage(src: Path, dst: Path) -> None:
        out = []
        for i, line in enumerate(src.read_text().splitlines()):
            try:
                value = json.loads(line)
            except ValueError:
                out.append(line)
                continue
            out.append(json.dumps(edit(i, value)))  # NaN is written as the literal NaN, as Python's json does
        dst.write_text("\n".join(out) + "\n")
    return damage


def retyped(field: str, value: Any) -> Damage:
    """`field` set to `value` in every line that has it."""
    return json_lines(lambda i, o: {**o, field: value} if field in o else o)


def at_lines(indexes: tuple[int, ...], **fields: Any) -> Damage:
    """These fields set in the lines with these indexes (negative: from the end)."""
    def damage(src: Path, dst: Path) -> None:
        count = len(src.read_text().splitlines())
        wanted = {i % count for i in indexes}
        json_lines(lambda i, o: {**o, **fields} if i in wanted else o)(src, dst)
    return damage


def json_doc(edit: Callable[[Any], Any]) -> Damage:
    """The good JSON file through edit(document)."""
    def damage(src: Path, dst: Path) -> None:
        value = edit(json.loads(src.read_text()))
        clear(dst)
        dst.write_text(json.dumps(value))
    return damage


def setting(*path: str | int, value: Any) -> Callable[[Any], Any]:
    """An edit for json_doc: the value at `path` replaced."""
    def edit(doc: Any) -> Any:
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return doc
    return edit


def every_value(value: Any) -> Callable[[Any], Any]:
    """An edit for json_doc: each value of the top-level object replaced."""
    return lambda doc: {k: value for k in doc}


# ---------------------------------------------------------------- cases


def commands(*labels: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((label, RUN_COMMANDS[label]) for label in labels)


def run_case(name: str, file: str, damage: Damage, readers: tuple[str, ...], *, refuse: tuple[str, ...] = (),
             source: str = "") -> Case:
    target = f"{RUN}/{file}"
    return Case(name, target, damage, commands(*readers), frozenset(refuse),
                source=source or f"runs/good/{file}")


def non_regular(prefix: str, file: str, readers: tuple[str, ...], refuse: tuple[str, ...]) -> list[Case]:
    """The file as a directory, a FIFO without a writer, a link to /dev/zero."""
    return [run_case(f"{prefix}-{kind}", file, damage, readers, refuse=refuse)
            for kind, damage in (("directory", directory), ("fifo", fifo), ("dev-zero", dev_zero))]


def unparsable(prefix: str, file: str, readers: tuple[str, ...], refuse: tuple[str, ...] = ()) -> list[Case]:
    """Empty, binary garbage, 100,000 nested brackets, 100,000 nested objects."""
    return [run_case(f"{prefix}-{kind}", file, damage, readers, refuse=refuse)
            for kind, damage in (("empty", EMPTY), ("binary", BINARY), ("nested-list", content(NESTED_LIST + "\n")),
                                 ("nested-dict", content(NESTED_DICT + "\n")))]


EVENTS = [
    *non_regular("events", "events.jsonl", EVENT_READERS, refuse=INTERPRETERS),
    *unparsable("events", "events.jsonl", EVENT_READERS),
    run_case("events-nested-list-line", "events.jsonl", appended(NESTED_LIST), EVENT_READERS),
    run_case("events-nested-dict-line", "events.jsonl", appended(NESTED_DICT), EVENT_READERS),
    run_case("events-non-object-lines", "events.jsonl", appended("[1, 2]", "3", "null", '"run.finished"'),
             EVENT_READERS),
    # One field of the wrong type: every reader gets events through the same RunDir.events / status fold; `report`
    # (the slowest reader, 2 s each) is covered by the structural cases around these, not by each field.
    *[run_case(f"events-{field}-{kind}", "events.jsonl", retyped(field, value), EVENT_FIELD_READERS)
      for field, kind, value in (
          ("t", "string", "1000"), ("t", "list", [1000]), ("t", "null", None), ("t", "bool", True),
          ("event", "list", ["run.finished"]), ("event", "dict", {"name": "run.finished"}), ("event", "number", 7),
          ("attempt", "list", [1]), ("attempt", "string", "1"), ("attempt", "float", 1.5),
          ("step", "string", "11"), ("cause", "dict", {"hang": True}), ("cause", "list", ["hang"]),
          ("committed_step", "string", "10"), ("resume_from_step", "list", [10]), ("nodes", "string", "n1"),
          ("nodes", "number", 2), ("job_id", "list", ["7"]), ("reason", "dict", {"x": 1}),
          ("detail", "list", ["x"]), ("seconds_since_start", "string", "20"), ("rank", "string", "1"),
          ("ratio", "string", "1.9"), ("total_steps", "string", "20"), ("excluded", "string", "n2"))],
    *[run_case(f"events-t-{kind}", "events.jsonl", at_lines((3, -1), t=value), EVENT_READERS)
      for kind, value in (("1e300", 1e300), ("minus-1e300", -1e300), ("NaN-string", "NaN"),
                          ("NaN-literal", math.nan), ("Infinity-literal", math.inf))],
    run_case("events-lone-surrogates", "events.jsonl",
             at_lines((1, 3, 7, -1), job_id="\udc80", nodes=["\udc80", "\ud800"], detail="\ud800\udc80x",
                      reason="\udc80", node="\ud800"), EVENT_READERS),
    run_case("events-surrogate-event-name", "events.jsonl", appended('{"t": 1200, "event": "\\udc80\\ud800"}'),
             EVENT_READERS),
    run_case("events-10MB-line", "events.jsonl",
             appended(json.dumps({"t": T0 + 124, "event": "attempt.failed", "attempt": 2, "detail": "x" * BIG})),
             EVENT_READERS),
    run_case("events-10MB-no-newline", "events.jsonl", appended("y" * BIG), EVENT_READERS),
]

RESOLVED = [
    # not there as a file: not a run directory for any command
    *[run_case(f"resolved-{kind}", "resolved.json", damage, ALL, refuse=tuple(set(ALL) - set(LS)))
      for kind, damage in (("directory", directory), ("fifo", fifo), ("dev-zero", dev_zero))],
    # not a JSON object
    *[run_case(f"resolved-{kind}", "resolved.json", damage, ALL, refuse=INTERPRETERS + ("diff",))
      for kind, damage in (("empty", EMPTY), ("binary", BINARY), ("nested-list", content(NESTED_LIST)),
                           ("nested-dict", content(NESTED_DICT)), ("list", content("[]")),
                           ("null", content("null")))],
    # an object without a usable trainer.steps, which status and report show (N of M steps)
    *[run_case(f"resolved-{kind}", "resolved.json", json_doc(edit), ALL, refuse=(*STATUS, "report"))
      for kind, edit in (("empty-object", lambda d: {}), ("trainer-null", setting("trainer", value=None)),
                         ("sections-null", every_value(None)),
                         ("steps-string", setting("trainer", "steps", value="20")),
                         ("steps-1e300", setting("trainer", "steps", value=1e300)))],
    # wrong types a reader may take as absent (a section without its defaults reads as the defaults)
    *[run_case(f"resolved-{kind}", "resolved.json", json_doc(edit), ALL)
      for kind, edit in (("resources-list", setting("resources", value=[])),
                         ("period-list", setting("checkpoint", "period", value=[5])),
                         ("launcher-dict", setting("launcher", value={"slurm": 1})))],
]

MANIFEST_READERS = (*STATUS, *LS, "report", "diff", "compare")
MANIFEST = [
    *non_regular("manifest", "manifest.json", MANIFEST_READERS, refuse=INTERPRETERS + ("diff",)),
    run_case("manifest-values-lists", "manifest.json", json_doc(lambda d: {k: [v] for k, v in d.items()}),
             MANIFEST_READERS),
    run_case("manifest-nested-wrong", "manifest.json", json_doc(lambda d: {
        **d, "image": {"sha256": ["x"], "path": 3}, "host": [1], "run": "x", "injections": {"spec": 1},
        "hashed_config": [[]]}), MANIFEST_READERS),
    run_case("manifest-list", "manifest.json", content("[]"), MANIFEST_READERS, refuse=INTERPRETERS + ("diff",)),
]

METRICS = [
    run_case("metrics-dir-is-a-file", "metrics", content('{"step": 1}\n'), EVENT_READERS),
    *non_regular("metrics0", "metrics/0.jsonl", EVENT_READERS, refuse=()),
    *unparsable("metrics0", "metrics/0.jsonl", EVENT_READERS),
    run_case("metrics0-10MB-line", "metrics/0.jsonl", appended(json.dumps({"step": 20, "loss": "x" * BIG})),
             EVENT_READERS),
    run_case("metrics-rank-name-huge", "metrics/" + "9" * 30 + ".jsonl", appended('{"step": 1}'), EVENT_READERS,
             source="runs/good/metrics/0.jsonl"),
    *[run_case(f"metrics0-{field}-{kind}", "metrics/0.jsonl", retyped(field, value), EVENT_READERS)
      for field, kind, value in (
          ("step", "list", [1]), ("step", "string", "1"), ("step", "negative", -1), ("step", "1e300", 1e300),
          ("loss", "string", "6.0"), ("loss", "NaN-literal", math.nan), ("loss", "list", [6.0]),
          ("step_time", "negative", -1.0), ("step_time", "huge", 1e308), ("step_time", "zero", 0),
          ("t", "string", "1000"), ("t", "NaN-literal", math.nan), ("attempt", "list", [1]),
          ("node", "dict", {"n": 1}), ("tokens_per_sec_per_device", "string", "64"),
          ("host_rss_bytes", "float", 1.5e300), ("device_memory_peak_bytes", "list", [1]))],
]

ATTEMPTS = [
    *[run_case(f"attempt-json-{kind}", "attempts/1/attempt.json", damage, ("status", "diff", "logs"))
      for kind, damage in (("directory", directory), ("fifo", fifo), ("dev-zero", dev_zero), ("binary", BINARY),
                           ("nested-list", content(NESTED_LIST)), ("list", content("[]")))],
    *[run_case(f"rank-log-{kind}", "attempts/2/rank-0.log", damage, ("logs", *STATUS, "compare"),
               refuse=("logs",) if kind in ("directory", "fifo", "dev-zero") else ())
      for kind, damage in (("directory", directory), ("fifo", fifo), ("dev-zero", dev_zero), ("binary", BINARY),
                           ("10MB-no-newline", content("z" * BIG)))],
    *[run_case(f"attempts-{kind}", "attempts", damage, (*STATUS, "report", "logs", "diff", "compare"))
      for kind, damage in (("a-file", content("x")), ("fifo", fifo))],
    run_case("attempt-dir-huge-number", "attempts/" + "9" * 30, directory, (*STATUS, "report", "logs", "compare")),
    *[run_case(f"env-capture-{kind}", "attempts/2/env/rank-0.json", damage, ("diff",))
      for kind, damage in (("fifo", fifo), ("dev-zero", dev_zero), ("binary", BINARY),
                           ("nested-list", content(NESTED_LIST)), ("list", content("[]")),
                           ("values-lists", json_doc(lambda d: {k: [v] for k, v in d.items()})))],
]

OUTCOME_READERS = (*STATUS, "compare")
OUTCOME = [
    # not a file: compare may refuse it or compute the outcome from the run's files, as without one
    *[run_case(f"outcome-{kind}", "outcome.json", damage, OUTCOME_READERS, source="good-outcome.json")
      for kind, damage in (("directory", directory), ("fifo", fifo), ("dev-zero", dev_zero))],
    # a file that is not an outcome record as rkit writes it
    *[run_case(f"outcome-{kind}", "outcome.json", damage, OUTCOME_READERS, source="good-outcome.json",
               refuse=("compare",))
      for kind, damage in (("empty", EMPTY), ("binary", BINARY), ("nested-list", content(NESTED_LIST)),
                           ("nested-dict", content(NESTED_DICT)), ("list", content("[]")),
                           ("empty-object", content("{}")),
                           ("loss-list", json_doc(setting("loss", value=[1.0]))),
                           ("per-step-list", json_doc(setting("loss", "per_step", value=[1.0]))),
                           ("per-step-key-not-a-step", json_doc(setting("loss", "per_step", value={"x": 1.0}))),
                           ("per-step-value-string", json_doc(setting("loss", "per_step", value={"1": "6.0"}))),
                           ("step-time-samples-strings", json_doc(setting("step_time", "samples", value=["a"]))))],
    *[run_case(f"outcome-{kind}", "outcome.json", json_doc(edit), OUTCOME_READERS, source="good-outcome.json")
      for kind, edit in (("per-step-NaN", setting("loss", "per_step", "12", value=math.nan)),
                         ("step-time-null", setting("step_time", value=None)),
                         ("surrogate-run", setting("run", value="\ud800")))],
]

TELEMETRY = [
    *[run_case(f"telemetry-n1-{kind}", "telemetry/n1.jsonl", damage, STATUS)
      for kind, damage in (("directory", directory), ("fifo", fifo), ("dev-zero", dev_zero), ("binary", BINARY),
                           ("nested-list", content(NESTED_LIST + "\n")), ("10MB-line", content("w" * BIG)),
                           ("t-string", retyped("t", "x")), ("t-NaN", retyped("t", math.nan)),
                           ("t-1e300", retyped("t", 1e300)))],
    run_case("telemetry-dir-is-a-file", "telemetry", content("x"), STATUS),
]


def bench_case(name: str, damage: Damage, *, refuse: bool = True) -> Case:
    argv = ("bench", "compare", "{case}/good-bench.json", "{case}/damaged-bench.json", "--storage", "{case}/store")
    return Case(f"bench-{name}", "damaged-bench.json", damage, (("bench compare", argv),),
                frozenset({"bench compare"} if refuse else ()), source="good-bench.json")


def stats(edit: Callable[[dict], None]) -> Damage:
    def apply(doc: dict) -> dict:
        edit(doc["benchmarks"][0])
        return doc
    return json_doc(apply)


BENCH = [
    bench_case("nested-list", content(NESTED_LIST)),
    bench_case("nested-dict", content(NESTED_DICT)),
    bench_case("fifo", fifo),
    bench_case("dev-zero", dev_zero),
    bench_case("directory", directory),
    bench_case("binary", BINARY),
    bench_case("benchmarks-null", json_doc(setting("benchmarks", value=None))),
    bench_case("extra-info-null", stats(lambda b: b.update(extra_info=None))),
    bench_case("extra-info-all-null", stats(lambda b: b.update(extra_info=dict.fromkeys(b["extra_info"])))),
    bench_case("extra-info-optional-null", stats(lambda b: b.update(extra_info={
        k: (v if k == "round_sizes" else None) for k, v in b["extra_info"].items()})), refuse=False),
    bench_case("round-sizes-past-data", stats(lambda b: b["extra_info"].update(round_sizes=[10 ** 6, -5, 1.5])),
               refuse=False),
    bench_case("stats-NaN", stats(lambda b: b["stats"].update(
        data=[math.nan] * len(b["stats"]["data"]), median=math.nan, mean=math.nan)), refuse=False),
    bench_case("stats-data-strings", stats(lambda b: b["stats"].update(data=["0.05"] * len(b["stats"]["data"])))),
    bench_case("stats-null", stats(lambda b: b.update(stats=None))),
]


def manifest_file_case(name: str, damage: Damage, *, refuse: bool = False) -> Case:
    argv = ("diff", "{case}/good-manifest.json", "{case}/damaged-manifest.json")
    return Case(f"manifest-file-{name}", "damaged-manifest.json", damage, (("diff", argv),),
                frozenset({"diff"} if refuse else ()), source="good-manifest.json")


MANIFEST_FILES = [
    manifest_file_case("values-lists", json_doc(lambda d: {k: [v] for k, v in d.items()})),
    manifest_file_case("host-list", json_doc(lambda d: {**d, "host": [1], "hashed_config": [1], "run": [2]})),
    manifest_file_case("nested-wrong", json_doc(lambda d: {**d, "host": {
        "python": [], "packages": [1], "environment": "x", "hardware": 3, "system": [], "jax": "x"},
        "injections": [1, None]})),
    manifest_file_case("list", content("[]"), refuse=True),
    manifest_file_case("nested-list", content(NESTED_LIST), refuse=True),
    manifest_file_case("fifo", fifo, refuse=True),
    manifest_file_case("dev-zero", dev_zero, refuse=True),
    manifest_file_case("binary", BINARY, refuse=True),
]


def option_case(name: str, argv: tuple[str, ...], option: str) -> Case:
    label = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    return Case(f"option-{name}", "", nothing, ((label, argv),), frozenset({label}), names=(option,))


COMPARE_GOOD = ("compare", "{good}", "{good}")
BENCH_GOOD = ("bench", "compare", "{case}/good-bench.json", "{case}/good-bench.json", "--storage", "{case}/store")
OPTIONS = [
    *[option_case(f"compare{opt}-{value}", (*COMPARE_GOOD, opt, value), opt)
      for opt in ("--threshold", "--loss-tolerance") for value in ("nan", "inf", "-1")],
    *[option_case(f"bench{opt}-{value}", (*BENCH_GOOD, opt, value), opt)
      for opt in ("--threshold", "--loss-tolerance") for value in ("nan", "inf")],
]


def recipe_case(name: str, *args: str, names: tuple[str, ...], target: str = "", damage: Damage = nothing) -> Case:
    argv = ("run", "{recipe}", "--dry-run", "-o", "runs_dir={case}/new-runs", *args)
    return Case(f"run-{name}", target, damage, (("run --dry-run", argv),), frozenset({"run --dry-run"}),
                names=names)


INJECT = ("--inject",)
BASE = ("base_config",)
TLS = ("tls_cert", "tls_key")
RECIPES = [
    recipe_case("inject-code-300", "--inject", "exit:rank=0,step=5,code=300", names=INJECT),
    recipe_case("inject-code-0", "--inject", "exit:rank=0,step=5,code=0", names=INJECT),
    recipe_case("inject-step-past-the-end", "--inject", "kill:rank=0,step=500", names=INJECT),
    recipe_case("inject-step-30-digits", "--inject", "kill:rank=0,step=" + "9" * 30, names=INJECT),
    recipe_case("inject-rank-99", "--inject", "kill:rank=99,step=5", names=INJECT),
    # a MaxText config must be a readable regular file: the key or the file is named
    *[recipe_case(f"base-config-{kind}", "-o", f"trainer.base_config={path}", names=(*BASE, shown),
                  target=target, damage=damage)
      for kind, path, shown, target, damage in (
          ("dev-zero", "/dev/zero", "/dev/zero", "", nothing),
          ("directory", "{case}/configs", "configs", "configs", directory),
          ("missing", "{case}/missing.yml", "missing.yml", "", nothing),
          ("etc-passwd", "../../../../../etc/passwd", "etc/passwd", "", nothing),
          ("fifo", "{case}/base.yml", "base.yml", "base.yml", fifo),
          ("binary", "{case}/base.yml", "base.yml", "base.yml", BINARY))],
    recipe_case("override-interpolation-in-list", "-o", 'trainer.overrides.mesh_axes=[data, "${x}"]',
                names=("trainer.overrides.mesh_axes",)),
    recipe_case("override-url-password", "-o", "trainer.overrides.dataset_path=gs://u:hunter2@bucket/x",
                names=("trainer.overrides.dataset_path",)),
    recipe_case("override-url-password-in-list", "-o", "trainer.overrides.mesh_axes=[data, 'https://u:hunter2@h/x']",
                names=("trainer.overrides.mesh_axes",)),
    recipe_case("tls-dev-zero", "-o", "observability.prometheus.tls_cert=/dev/zero", "-o",
                "observability.prometheus.tls_key=/dev/zero", names=(*TLS, "/dev/zero")),
    recipe_case("tls-fifo", "-o", "observability.prometheus.tls_cert={case}/cert.pem", "-o",
                "observability.prometheus.tls_key={case}/cert.pem", names=(*TLS, "cert.pem"), target="cert.pem",
                damage=fifo),
    recipe_case("tls-directory", "-o", "observability.prometheus.tls_cert={case}/certs", "-o",
                "observability.prometheus.tls_key={case}/certs", names=(*TLS, "certs"), target="certs",
                damage=directory),
]


def image_case(name: str, damage: Damage, *argv: str) -> Case:
    label = f"image {argv[0]}"
    return Case(f"image-{argv[0]}-{name}", "damaged.sif", damage, ((label, ("image", *argv)),), frozenset({label}))


IMAGES = [
    *[image_case(kind, damage, "verify", "{case}/damaged.sif", "--expect", "sha256:" + "0" * 64)
      for kind, damage in (("fifo", fifo), ("dev-zero", dev_zero), ("directory", directory))],
    image_case("fifo", fifo, "inspect", "{case}/damaged.sif"),
]

CONTROLS = [
    Case("control-good-run", "", nothing, commands(*ALL), ok=True),
    Case("control-bench", "", nothing, (("bench compare", BENCH_GOOD),), ok=True),
    Case("control-manifest-files", "", nothing,
         (("diff", ("diff", "{case}/good-manifest.json", "{case}/good-manifest.json")),), ok=True),
    Case("control-recipe", "", nothing, (("run --dry-run", ("run", "{recipe}", "--dry-run", "-o",
                                                              "runs_dir={case}/new-runs")),), ok=True),
]

CORPUS: list[Case] = [*CONTROLS, *EVENTS, *RESOLVED, *MANIFEST, *METRICS, *ATTEMPTS, *OUTCOME, *TELEMETRY, *BENCH,
                      *MANIFEST_FILES, *OPTIONS, *RECIPES, *IMAGES]
assert len({c.name for c in CORPUS}) == len(CORPUS), "case names are unique"


def prepare(case: Case, good: Path, folder: Path) -> None:
    """`folder` as a copy of the good inputs, with the case's damage done."""
    shutil.copytree(good, folder, symlinks=True, dirs_exist_ok=True)
    if case.target:
        target = folder / case.target
        target.parent.mkdir(parents=True, exist_ok=True)
        case.damage(folder / (case.source or case.target), target)


def expand(argv: tuple[str, ...], folder: Path) -> list[str]:
    places = {"{case}": folder, "{run}": folder / RUN, "{good}": folder / "runs" / "good",
              "{runs}": folder / "runs", "{recipe}": TINY}
    out = []
    for arg in argv:
        for key, value in places.items():
            arg = arg.replace(key, str(value))
        out.append(arg)
    return out

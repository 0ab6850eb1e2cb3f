"""Fuzz corpus for user input: every recipe or -o value gives exit 0 or 2, never a traceback, and never hangs.
Each answer takes about 1 s on the loaded 2-core machine (the slowest, 100,000 nested brackets, 1.06 s); the
subprocess timeout that catches a hang is HANG seconds, far above that, so a busy machine does not fail it.

The corpus runs `rkit validate` as a subprocess (under a 1 GiB address-space limit, so that reading /dev/zero
cannot eat the machine); the hypothesis tests call the parser in-process with generated YAML and overrides.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rkit.contract.defaults import schema
from rkit.contract.errors import RkitError
from rkit.recipe.load import parse_recipe

from ..conftest import REPO, TINY

SLURM = (REPO / "recipes" / "tiny-slurm.yaml").read_text()
CPU = TINY.read_text()
DIGITS = "9" * 5000
N = 100_000
HANG = 60  # seconds: a read of /dev/zero or a FIFO would block forever


def set_key(text: str, key: str, value: str) -> str:
    """`text` with the (first) line `key: ...` replaced by `key: value`, at its own indentation."""
    new, n = re.subn(rf"^(\s*){key}:.*$", lambda m: f"{m.group(1)}{key}: {value}", text, count=1, flags=re.M)
    assert n == 1, key
    return new


def add_key(text: str, section: str, line: str) -> str:
    """`text` with `line` added as the first key of the top-level `section`."""
    assert f"\n{section}:\n" in text, section
    return text.replace(f"\n{section}:\n", f"\n{section}:\n  {line}\n", 1)


Make = Callable[[Path], Path]


def file(content: str | bytes) -> Make:
    def make(d: Path) -> Path:
        path = d / "recipe.yaml"
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path
    return make


def fifo(d: Path) -> Path:
    os.mkfifo(d / "recipe.yaml")
    return d / "recipe.yaml"


def directory(d: Path) -> Path:
    (d / "recipe.yaml").mkdir()
    return d / "recipe.yaml"


def case(id: str, make: Make, *overrides: str | bytes, key: str = "", rc: int = 2, words: str = ""):
    return pytest.param(make, overrides, key, rc, words, id=id)


CORPUS = [
    case("control-tiny-cpu", file(CPU), rc=0),
    case("control-tiny-slurm", file(SLURM), rc=0),
    # numbers YAML or Python cannot (or should not) turn into a step count or a timeout
    case("steps-5000-digits", file(set_key(CPU, "steps", DIGITS)), key="trainer.steps"),
    case("steps-5000-digits-o", file(CPU), f"trainer.steps={DIGITS}", key="trainer.steps"),
    case("hang-timeout-inf-o", file(CPU), "resilience.hang_timeout=.inf", key="resilience.hang_timeout"),
    case("hang-timeout-nan-o", file(CPU), "resilience.hang_timeout=nan", key="resilience.hang_timeout"),
    case("hang-timeout-.nan-o", file(CPU), "resilience.hang_timeout=.nan", key="resilience.hang_timeout"),
    case("hang-timeout-1e999-o", file(CPU), "resilience.hang_timeout=1e999", key="resilience.hang_timeout"),
    # YAML timestamps that are not dates
    case("bad-date-env", file(set_key(CPU, "env", "{RELEASE: 2024-13-45}")), key="env.RELEASE"),
    case("bad-date-env-o", file(CPU), "env.RELEASE=2024-13-45", key="env.RELEASE"),
    case("bad-date-unknown-key", file("name: t\nreleased: 2024-13-45\n"), key="released"),
    # paths that are not regular files
    case("dev-zero", lambda d: Path("/dev/zero")),
    case("fifo", fifo),
    case("directory", directory, words="directory"),
    case("missing", lambda d: d / "recipe.yaml"),
    case("2-MiB", file(b"name: x\n" + b"#" * (2 << 20))),
    # bytes that are not UTF-8 (argv arrives with surrogate escapes)
    case("non-utf8-o-value", file(CPU), b"name=a\xff", key="name"),
    case("non-utf8-o-key", file(CPU), b"trainer.st\xffps=3", key="trainer.st"),
    case("non-utf8-file", file(b"name: t\xff\ntrainer: {kind: maxtext, steps: 3}\n")),
    case("binary-file", file(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)),
    # newlines where sbatch or a path would take them
    case("name-newline-o", file(CPU), "name=t\n", rc=0),  # -o values are YAML scalars: this one reads as "t"
    case("name-newline", file(set_key(CPU, "name", '"t\\n"')), key="name"),
    case("partition-newline", file(set_key(SLURM, "partition", '"debug\\n"')), key="slurm.partition"),
    case("qos-newline", file(add_key(SLURM, "slurm", 'qos: "normal\\n"')), key="slurm.qos"),
    case("time-newline", file(set_key(SLURM, "time", '"00:30:00\\n"')), key="slurm.time"),
    case("extra-sbatch-newline", file(add_key(SLURM, "slurm", 'extra_sbatch: ["--comment=x\\n"]')),
         key="slurm.extra_sbatch[0]"),
    # nesting
    case("nested-brackets-open", file("[" * N)),
    case("nested-brackets-closed", file("[" * N + "]" * N)),
    case("nested-flow-mappings", file("{a: " * N + "1" + "}" * N)),
    case("nested-block", file("".join(f"{' ' * i}a:\n" for i in range(2000)))),
    # sbatch options by a prefix sbatch accepts, and --export (would drop the environment rkit relies on)
    *[case(f"extra-sbatch-{opt}", file(add_key(SLURM, "slurm", f'extra_sbatch: ["{opt}"]')),
           key="slurm.extra_sbatch[0]") for opt in ("--outp=x", "--chdi=/", "--export=NONE", "--contain=x")],
    case("time-base-60", file(set_key(SLURM, "time", "1:30:00")), rc=0),  # taken as written, not as 5400
    # runs_dir characters that Slurm's --output patterns or PATH-like lists treat specially
    *[case(f"runs-dir-{c}", file(CPU), f"runs_dir=/tmp/a{c}b", key="runs_dir") for c in ",:%"],
    # runs_dir that cannot hold a run directory (a traceback from mkdir before)
    case("runs-dir-a-file", file(CPU), "runs_dir=recipe.yaml", key="runs_dir", words="is not a directory"),
    case("runs-dir-under-a-file", file(CPU), "runs_dir=recipe.yaml/runs", key="runs_dir", words="is a file"),
    case("runs-dir-dev-null", file(CPU), "runs_dir=/dev/null", key="runs_dir", words="virtual file system"),
    case("runs-dir-proc", file(CPU), "runs_dir=/proc/runs", key="runs_dir", words="virtual file system"),
    # 2,000 unknown MaxText keys: the first 100 printed, the rest counted (40,000 printed 40,001 lines before)
    case("many-unknown-keys", file(CPU.replace("  overrides:\n", "  overrides:\n" + "".join(
        f"    unknown_{i}: 1\n" for i in range(2000)), 1)), key="trainer.overrides.unknown_", words="and 1900 more"),
    # a multi-line private key under a harmless name: refused, its key named, the key itself never printed
    case("env-private-key-multiline", file(set_key(CPU, "env", '{SOMETHING: "-----BEGIN OPENSSH PRIVATE KEY-----\\n'
                                                                'abc\\n-----END OPENSSH PRIVATE KEY-----"}')),
         key="env.SOMETHING", words="control character"),
    # secrets in the recipe (it is copied into the run directory)
    case("env-MY_PASSWD", file(set_key(CPU, "env", "{MY_PASSWD: x}")), key="env.MY_PASSWD"),
    case("env-GITHUB_PAT", file(set_key(CPU, "env", "{GITHUB_PAT: x}")), key="env.GITHUB_PAT"),
    case("env-url-password", file(set_key(CPU, "env", '{DATABASE_URL: "postgres://u:pw@host/db"}')),
         key="env.DATABASE_URL"),
    case("hf-access-token-o", file(CPU), "trainer.overrides.hf_access_token=hf_x",
         key="trainer.overrides.hf_access_token"),
    case("oc-env-interpolation-o", file(CPU), "trainer.overrides.dataset_path=${oc.env:HOME}",
         key="trainer.overrides.dataset_path"),
    # YAML features a recipe does not use
    case("alias", file("name: &n t\ntrainer: {kind: maxtext, steps: *n}\n")),
    case("billion-laughs", file("a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nname: t\n")),
    case("duplicate-key", file(CPU + "name: again\n"), key="name"),
    case("python-tag", file("name: !!python/name:os.system t\ntrainer: {kind: maxtext, steps: 3}\n")),
    case("binary-tag", file(set_key(CPU, "env", "{BLOB: !!binary aGk=}")), key="env.BLOB"),
    case("complex-key", file("? [a, b]\n: 1\nname: t\n")),
    case("int-key", file(CPU + "1: x\n")),
    case("list-top-level", file("- name: t\n")),
    case("scalar-top-level", file("just text\n")),
    case("empty", file("")),
    case("only-comment", file("# nothing\n")),
    # overrides that are not key.path=value, or go through a value
    case("o-no-equals", file(CPU), "trainer"),
    case("o-empty-part", file(CPU), "trainer..steps=3"),
    case("o-through-scalar", file(CPU), "name.x=1", key="name"),
    case("o-through-list", file(SLURM), "slurm.extra_sbatch.x=1"),
]


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


@pytest.mark.parametrize(("make", "overrides", "key", "rc", "words"), CORPUS)
def test_corpus_exits_0_or_2_and_never_hangs(tmp_path: Path, make: Make, overrides: tuple, key: str, rc: int,
                                        words: str):
    recipe = make(tmp_path)
    argv = [sys.executable, "-m", "rkit.cli", "validate", str(recipe)]
    for item in overrides:
        argv += ["-o", item]
    try:
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, stdin=subprocess.DEVNULL, timeout=HANG,
                              preexec_fn=limit_memory, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"rkit validate {recipe} {overrides!r}: no answer within {HANG} s")
    out, err = (s.decode("utf-8", "replace") for s in (done.stdout, done.stderr))
    last = err.strip().splitlines()[-1:] or ["(no stderr)"]
    assert "Traceback" not in out + err, f"exit {done.returncode}: {last[0]}\n{err[-3000:]}"
    assert done.returncode == rc, f"exit {done.returncode}: {last[0]}"
    if rc == 2:
        assert str(recipe) in err, err
        assert key in err, err
        assert words in err.lower(), err
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["recipe.yaml"])  # nothing written


# ---------------------------------------------------------------- in-process: hypothesis


def _names(node: dict) -> set[str]:
    props = node.get("properties", {})
    names = set(props)
    for sub in [*props.values(), node.get("items")]:
        if isinstance(sub, dict) and sub:
            names |= _names(sub)
    return names


BASES = [yaml.safe_load(CPU), yaml.safe_load(SLURM)]
KEYS = sorted(_names(schema()) | set(BASES[0]["trainer"]["overrides"]) | {"MY_TOKEN", "PATH"})
PATHS = sorted({f"{s}.{k}" for base in BASES for s, v in base.items() if isinstance(v, dict) for k in v}
               | {s for base in BASES for s in base} | {"trainer.overrides.hf_access_token", "env.HOME"})

hostile_char = st.characters() | st.sampled_from(list("\n\r\t\x00\x85\u2028\udcff\udc80=.:,%{}[]&*!|>'\"#$"))
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.dates() | st.text(hostile_char.filter(
    lambda c: not 0xD800 <= ord(c) <= 0xDFFF), max_size=20) | st.sampled_from(["1:30:00", "2024-13-45", "--outp=x"]))
trees = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                     | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), kids, max_size=4), max_leaves=12)
override = st.builds("{}={}".format, st.sampled_from(PATHS) | st.text(hostile_char, max_size=20),
                     st.text(hostile_char, max_size=20) | st.sampled_from([".inf", "nan", "1e999", DIGITS, "[1"]))
overrides = st.lists(override | st.text(hostile_char, max_size=20), max_size=3)
yaml_like = st.text(st.sampled_from(list("abcnmetrkisp:-[]{}#&*!|>'\"\n\t 0123456789.,?%@`")), max_size=200)


def parses_or_refuses(text: str, items: list[str]) -> None:
    """A recipe that parses also hashes and builds its config; anything else is an RkitError."""
    try:
        recipe = parse_recipe("fuzz.yaml", text, items)
        assert recipe.config_hash.startswith("sha256:")
        assert recipe.config is not None
    except RkitError as exc:
        assert str(exc)


fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])


@fuzz
@given(text=yaml_like | st.text(max_size=200), items=overrides)
@example(text="?", items=["0="])  # a null key beside a string one: a TypeError sorting the unknown keys, found here
def test_text_and_overrides_parse_or_refuse(text: str, items: list[str]):
    parses_or_refuses(text, items)


@fuzz
@given(tree=st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), trees, max_size=6), items=overrides)
def test_generated_structures_parse_or_refuse(tree: dict, items: list[str]):
    parses_or_refuses(yaml.safe_dump(tree, allow_unicode=True), items)


@fuzz
@given(base=st.sampled_from(BASES), path=st.sampled_from(PATHS), value=trees, items=overrides)
@example(base=BASES[0], path="slurm", value={"extra_sbatch": True}, items=[])  # a TypeError once, found here
def test_real_recipes_with_one_value_replaced_parse_or_refuse(base: dict, path: str, value, items: list[str]):
    data = yaml.safe_load(yaml.safe_dump(base))
    section, _, key = path.partition(".")
    if key and isinstance(data.get(section), dict):
        data[section][key] = value
    else:
        data[section] = value
    parses_or_refuses(yaml.safe_dump(data, allow_unicode=True), items)


def test_a_problem_quoting_a_private_key_names_its_key_and_shows_no_part_of_the_key():
    from rkit.contract.errors import Problem

    block = "-----BEGIN OPENSSH PRIVATE KEY-----\nsecretbody\n-----END OPENSSH PRIVATE KEY-----"
    for quoted in (repr(block), repr(block)[:50] + "..."):  # whole, and cut short as messages quote long values
        line = Problem("env.SOMETHING", f"{quoted} holds the control character '\\n'", 5).render("r.yaml")
        assert line.startswith("r.yaml:5: env.SOMETHING: '<redacted>") and "control character" in line, line
        assert "secretbody" not in line and "BEGIN" not in line, line


def _json_loads_line(raw: bytes | str):
    """parse_line as json.loads reads a line (its reference: parse_line calls json's scanner directly)."""
    from rkit.contract.safeio import MAX_LINE_BYTES, clean

    if len(raw) > MAX_LINE_BYTES or not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return clean(value) if ((b"\\u" in raw) if isinstance(raw, bytes) else ("\\u" in raw)) else value


@fuzz
@given(raw=st.one_of(st.binary(max_size=40), st.text(max_size=40),
                     st.builds(lambda v, pad: (pad + json.dumps(v, default=str) + pad[::-1]).encode(
                         "utf-8", "surrogatepass"),
                               trees, st.sampled_from(["", " ", "\t", "\r", "\ufeff", "\x00", "\u2028"])),
                     st.sampled_from([b"\xef\xbb\xbf{}", "\ufeff{}", b'{"a": NaN}', b"{} {}", b"\xed\xa0\x80",
                                      b'"\xed\xa0\x80"', b"[1] ", b" \n", b"{\x00}", b'{"\\ud800": 1}',
                                      # where msgspec's decoder (safeio's first) and json's could part: numbers
                                      # beyond int64 and beyond a float, duplicate keys, deep nesting
                                      b'{"a": 123456789012345678901234567890}', b'{"a": -9223372036854775809}',
                                      b'{"a": 1e400}', b'{"a": 5e-400}', b'{"a": 1, "a": 2}',
                                      b'{"a": ' * 2000 + b"1" + b"}" * 2000, b'{"a": -0.0, "b": 1E5}',
                                      b'{"a": "\\udc80"}', b'{"a": "\\ud83d\\ude00"}'])))
def test_a_json_line_reads_as_json_loads_reads_it(raw):
    from rkit.contract import safeio
    from rkit.contract.safeio import parse_line

    assert safeio._FAST is not None  # the cpu lock's msgspec: the fast path is the one under test here
    got, want = parse_line(raw), _json_loads_line(raw)
    assert json.dumps(got, sort_keys=True, allow_nan=True) == json.dumps(want, sort_keys=True, allow_nan=True), raw

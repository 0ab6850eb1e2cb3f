"""Reading files rkit did not necessarily write intact: a run directory's files after crashes, full disks, copies
and other users, and the files given to `diff`, `compare` and `bench compare`.

Only regular files are read: a FIFO, a device (a link to /dev/zero) or a directory is refused, and the open is
non-blocking, so that a FIFO without a writer cannot make the open itself wait. A JSON object file is bounded in
bytes; a JSON-lines record is bounded per line and parsed without letting deep nesting escape as a
RecursionError; lone surrogates (valid JSON escapes, invalid UTF-8) become U+FFFD so that nothing downstream
fails to write them. What cannot be read is an RkitError naming the file (exit 2); a reader that must go on
(`rkit ls` of many runs, `status` of a run with one bad line) catches it or skips the record.

The standard library is enough: the agent reads through it too (image side), in images that may lack msgspec.
Where msgspec is installed (the cpu lock), a line is parsed by its decoder first, 4-5x faster than json's (a long
run's first `rkit status` is mostly this); a line it refuses (NaN, a number beyond a float, a lone surrogate, a
byte order mark, anything damaged) goes through json as before, so the result is json's for every line."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from rkit.contract.errors import RkitError

MAX_OBJECT_BYTES = 256 << 20  # resolved.json, manifest.json, attempt.json, outcome.json, a saved benchmark
MAX_LINE_BYTES = 8 << 20  # one event, metrics or telemetry line
KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class Unreadable(RkitError, OSError):
    """A file rkit must read but cannot (permissions, a parent that is not a directory, I/O). An OSError too:
    readers that treat an unreadable file as missing go on as they did."""


class NotRegular(Unreadable):
    """A path that is not a regular file where rkit reads one."""


def kind_of(mode: int) -> str:
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def open_regular(path: Path | str) -> IO[bytes]:
    """`path` opened for reading if it is a regular file (after links); FileNotFoundError as open() raises it,
    NotRegular for anything else that is there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise Unreadable(f"{path}: cannot be read: {exc.strerror or exc}. Check the file and its directory (a "
                         "damaged run directory: restore it from a copy).") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(f"{path}: is {kind_of(mode)}, not a regular file; rkit reads only regular files here. "
                         "Move it away or restore the file from a copy.")
    return os.fdopen(fd, "rb")


def private_dir(path: Path | str) -> Path:
    """`path`, every directory made on the way to it created 0700 (a cache, the benchmark storage: what one user
    keeps for themselves). Directories already there keep their modes (a cache shared on purpose stays shared)."""
    path = Path(path)
    missing = []
    at = path
    while not os.path.lexists(at) and at != at.parent:
        missing.append(at)
        at = at.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            pass
    return path


def read_bytes(path: Path | str, limit: int, what: str = "file") -> bytes:
    """At most `limit` bytes of a regular file; a longer one is an RkitError."""
    with open_regular(path) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise RkitError(f"{path}: larger than {limit >> 20} MiB, which no {what} rkit writes is; it is damaged or "
                        "not the right file. Restore it from a copy.")
    return data


def load_json(path: Path | str, what: str = "JSON file", limit: int = MAX_OBJECT_BYTES) -> Any:
    """The JSON value of a file (RkitError naming the file when it cannot be read or parsed)."""
    try:
        data = read_bytes(path, limit, what)
    except NotRegular:
        raise
    except FileNotFoundError:
        raise RkitError(f"{path}: no such file; give the {what}.") from None
    except OSError as exc:
        raise RkitError(f"{path}: cannot be read: {exc.strerror or exc}.") from None
    try:
        return clean(json.loads(data.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RkitError(f"{path}: damaged, not valid JSON ({type(exc).__name__}: {str(exc)[:120]}); it is not a "
                        f"{what} as rkit writes it. Restore it from a copy.") from None


# json's own scanner, called on each line's text: what json.loads does for a str without its wrapper's cost
# (an encoding guess and two regex passes per call, a third of a long file's read). The result is the same.
_SCAN = json.JSONDecoder().scan_once
_JSON_SPACE = " \t\n\r"

try:  # what msgspec decodes, it decodes as json does (integers of any size exact, the last duplicate key kept)
    import msgspec as _msgspec

    _FAST = _msgspec.json.Decoder().decode
    _FAST_REFUSED: tuple[type[BaseException], ...] = (_msgspec.DecodeError, ValueError, RecursionError)
except ImportError:  # an image without it: json alone
    _FAST = None
    _FAST_REFUSED = ()


def parse_line(raw: bytes | str) -> Any:
    """One JSON-lines record, or None where it is not one (too long, cut, nested too deep, not JSON)."""
    if len(raw) > MAX_LINE_BYTES:
        return None
    if _FAST is not None:
        try:  # msgspec refuses a lone surrogate escape: what it returns has nothing for clean() to mend
            return _FAST(raw)
        except _FAST_REFUSED:
            pass  # json's verdict, below
    text = None
    if isinstance(raw, str):
        text = raw
    elif b"\x00" not in raw[:4] and not raw.startswith(b"\xef\xbb\xbf"):  # else json.loads guesses the encoding
        try:
            text = raw.decode("utf-8", "surrogatepass")  # as json.loads decodes bytes
        except UnicodeDecodeError:
            return None
    if text is not None:
        text = text.strip(_JSON_SPACE)
        if not text or text[0] == "\ufeff":  # json.loads refuses a str that starts with a byte order mark
            return None
        try:
            value, end = _SCAN(text, 0)
        except (StopIteration, ValueError, RecursionError):
            return None
        if end != len(text):  # json.loads's "Extra data"
            return None
    else:
        if not raw.strip():
            return None
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            return None
    has_escape = (b"\\u" in raw) if isinstance(raw, bytes) else ("\\u" in raw)
    return clean(value) if has_escape else value


def clean(value: Any, depth: int = 0) -> Any:
    """Lone surrogates (from `\\udc80` escapes) replaced by U+FFFD, in every string of a parsed value."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    if depth > 200:  # json.loads nests at most as deep as the interpreter's recursion allows
        return value
    if isinstance(value, dict):
        return {clean(k, depth + 1): clean(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v, depth + 1) for v in value]
    return value


def finite(value: Any) -> bool:
    """A real number (not a flag, not NaN or an infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------- JSON lines (events, metrics, telemetry)


def objects(raw_lines: Iterable[bytes | str], valid: Callable[[dict], bool] | None = None) -> Iterator[dict]:
    """The JSON objects among lines (those `valid` accepts); a line cut short by a crash (or joined to the
    next), nested too deep, too long or of the wrong shape is skipped."""
    for raw in raw_lines:
        value = parse_line(raw)
        if isinstance(value, dict) and (valid is None or valid(value)):
            yield value


def lines_of(fh: IO[bytes]) -> Iterator[bytes]:
    """The lines of a file, each at most MAX_LINE_BYTES (the rest of a longer one is skipped, unread into
    memory)."""
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while (more := fh.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                pass
            continue
        yield line


def read_jsonl(path: Path, valid: Callable[[dict], bool] | None = None) -> Iterator[dict]:
    """Every object of a JSON-lines file (events, metrics, telemetry), in file order; nothing for a missing
    file, NotRegular for a FIFO, a device or a directory."""
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        return
    with fh:
        yield from objects(lines_of(fh), valid)


def last_jsonl(path: Path, tail_bytes: int = 65536) -> dict | None:
    """The newest whole object of a JSON-lines file, read from its end: metrics and telemetry grow for days."""
    try:
        with open_regular(path) as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail_bytes))
            chunk = fh.read(tail_bytes)
    except OSError:
        return None
    return next(objects(reversed(chunk.split(b"\n"))), None)


def tail_jsonl(path: Path, tail_bytes: int, valid: Callable[[dict], bool] | None = None,
               having: tuple[bytes, ...] = ()) -> list[dict]:
    """The whole objects among a JSON-lines file's last `tail_bytes` (all of a smaller file), in file order: what a
    reader needs of a file that grows for weeks costs the same on day 30 as on day 1. With `having`, only lines
    that contain one of those byte strings are parsed (a cheap first sieve: `valid` still decides)."""
    try:
        with open_regular(path) as fh:
            fh.seek(0, os.SEEK_END)
            start = max(0, fh.tell() - tail_bytes)
            fh.seek(start)
            chunk = fh.read(tail_bytes)
    except OSError:
        return []
    lines = chunk.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first is a line's end
    if having:
        lines = [line for line in lines if any(h in line for h in having)]
    return list(objects(lines, valid))


class JsonlTail:
    """Follows one JSON-lines file as it grows (a line still being written waits for its newline)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self._partial = b""

    def skip_existing(self) -> None:
        try:
            self.offset = self.path.stat().st_size
        except FileNotFoundError:
            self.offset = 0

    def poll_raw(self) -> list[dict]:
        """The whole JSON objects appended since the last poll."""
        try:
            with open_regular(self.path) as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < self.offset:  # truncated (MaxText empties its file when it starts from step 0)
                    self.offset, self._partial = 0, b""
                fh.seek(self.offset)
                chunk = fh.read(64 << 20)
                self.offset = fh.tell()
        except OSError:  # missing, or not a regular file: nothing to follow
            return []
        parts = (self._partial + chunk).split(b"\n")
        self._partial = parts.pop()
        if len(self._partial) > MAX_LINE_BYTES:  # no newline for this long: not a record
            self._partial = b""
        return list(objects(parts))

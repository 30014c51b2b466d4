"""Reading the per-rank record files back (launcher and `synccheck report` side; no torch).

Files are read as a stream, one line at a time, and folded into a per-rank summary as they go
(summary.py): no event is kept, so the memory a report needs does not grow with the length of the run,
and a pool of processes reads several files at once. A record file may end in a half-written line (the
rank was killed mid-write): that line is dropped, everything before it is kept.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from synccheck.profiler import fold as F
from synccheck.profiler import recorder as R

# A record line is a few hundred bytes (the meta line holds the command line): anything longer is not
# ours, and is skipped without being held in memory.
MAX_LINE = 1 << 20


class UnknownVersion(Exception):
    """A rank file written by a newer synccheck (or not by synccheck at all)."""


@dataclass
class RankRecord:
    path: str
    meta: dict
    events: list = field(default_factory=list)    # only filled by read_rank_file
    truncated: bool = False

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def pid(self) -> int:
        return int(self.meta.get("pid", 0))


def check_version(meta: dict, path: str) -> None:
    version = meta.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= R.FORMAT_VERSION:
        raise UnknownVersion(f"{os.path.basename(path)}: record version {version!r} is not one this synccheck "
                             f"reads (1 to {R.FORMAT_VERSION}; a newer synccheck wrote it?): rank "
                             f"{meta.get('rank', '?')} left out")


def _lines(fh):
    """The file's lines (bytes), a line longer than MAX_LINE skipped (yielded as b"" once)."""
    readline = fh.readline
    while True:
        raw = readline(MAX_LINE)
        if not raw:
            return
        if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
            while True:        # the rest of an over-long line: read and drop in pieces
                more = readline(MAX_LINE)
                if not more or more.endswith(b"\n"):
                    break
            yield b"\0"
            continue
        yield raw


def _int(b: bytes):
    return None if b == b"null" else int(b)


class EventReader:
    """One rank file as a stream of events, paths resolved; "agg" and "prog" records decoded into
    ["agg", t, n, optimizer_index, path, line, checksum, Totals] and ["prog", t, Totals]."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.meta: dict | None = None
        self.bad_lines = 0          # lines that are not records (a partial last line, garbage)

    def events(self):
        paths: dict = {}
        path_of = paths.get
        loads = json.loads
        kinds = F.PATH_FIELD

        def resolve(p):
            return path_of(p, p)

        last_rest, last_totals = None, None
        last_head, head_values = None, None
        with open(self.path, "rb") as fh:
            for raw in _lines(fh):
                if raw.startswith(b'["agg",'):
                    # The common line, read without a full JSON parse: the step's numbers, then its totals,
                    # parsed once for a run of steps that did the same (consumers never change a Totals).
                    parts = raw.split(b",", 7)
                    try:
                        rest = parts[7]
                        if rest != last_rest:
                            last_totals = F.Totals.from_fields(loads(b"[" + rest), resolve)
                            last_rest = rest
                        head = parts[3:7]          # optimizer, path, line, checksum: mostly alike too
                        if head != last_head:
                            head_values = (_int(parts[3]), resolve(_int(parts[4])), _int(parts[5]), _int(parts[6]))
                            last_head = head
                        yield [F.AGG, int(parts[1]), int(parts[2]), *head_values, last_totals]
                        continue
                    except (ValueError, TypeError, IndexError, KeyError, AttributeError):
                        pass     # not that simple: parsed below
                try:
                    ev = loads(raw)
                    kind = ev[0]
                except (ValueError, TypeError, IndexError, KeyError):
                    if raw.strip():
                        self.bad_lines += 1
                    continue
                try:
                    if kind == F.AGG:
                        yield [kind, ev[1], ev[2], ev[3], resolve(ev[4]), ev[5], ev[6],
                               F.Totals.from_fields(ev[7:], resolve)]
                    elif kind == F.PROG:
                        yield [kind, ev[1], F.Totals.from_fields(ev[2:], resolve)]
                    elif kind == F.PATH:
                        paths[ev[1]] = ev[2]
                    elif kind == F.META:
                        if self.meta is None and isinstance(ev[1], dict):
                            self.meta = ev[1]
                            check_version(ev[1], self.path)
                    else:
                        i = kinds.get(kind)
                        if i is not None and len(ev) > i and isinstance(ev[i], int):
                            ev[i] = path_of(ev[i], ev[i])
                        yield ev
                except (ValueError, TypeError, IndexError, KeyError, AttributeError):
                    self.bad_lines += 1


def read_rank_file(path: str) -> RankRecord | None:
    """Every event of one rank file in memory (for --trace, one rank at a time)."""
    reader = EventReader(path)
    try:
        events = list(reader.events())
    except (OSError, UnknownVersion):
        return None
    if reader.meta is None or "rank" not in reader.meta:
        return None
    return RankRecord(path=path, meta=reader.meta, events=events, truncated=bool(reader.bad_lines))


def read_meta(path: str) -> dict | None:
    """The meta record on a rank file's first line, without reading the rest (None until it is written)."""
    try:
        with open(path, "rb") as fh:
            ev = json.loads(fh.readline(MAX_LINE))
    except (OSError, ValueError):
        return None
    if isinstance(ev, list) and len(ev) == 2 and ev[0] == R.META and isinstance(ev[1], dict) \
            and "pid" in ev[1] and "rank" in ev[1] and isinstance(ev[1]["rank"], int):
        return ev[1]
    return None


def rank_files(out_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(glob.escape(out_dir), "rank-*.jsonl")))


def load_ranks(out_dir: str, session: str | None = None) -> tuple[list[RankRecord], list[str]]:
    """Every rank found in `out_dir` (only `session`'s when given), one record per rank, from the first
    line of each file (the events are read later, by summary.summarize_all).

    A folder used by several runs can hold several files for one rank; the newest wins and a note says
    so. A file of an unknown record version is left out with a note. Returns (records sorted by rank,
    notes)."""
    notes: list[str] = []
    by_rank: dict[int, RankRecord] = {}
    duplicates = 0
    for path in rank_files(out_dir):
        meta = read_meta(path)
        if meta is None:
            continue
        if session is not None and meta.get("session") != session:
            continue
        try:
            check_version(meta, path)
        except UnknownVersion as exc:
            notes.append(str(exc))
            continue
        record = RankRecord(path=path, meta=meta)
        previous = by_rank.get(record.rank)
        if previous is not None:
            duplicates += 1
            if previous.meta.get("t0", 0) >= record.meta.get("t0", 0):
                continue
        by_rank[record.rank] = record
    if duplicates:
        notes.append(f"{out_dir} holds records of more than one run; the newest file of each rank is used")
    return [by_rank[r] for r in sorted(by_rank)], notes


def load_process_markers(out_dir: str, session: str | None = None) -> list[dict]:
    markers = []
    for path in sorted(glob.glob(os.path.join(out_dir, "proc.*.json"))):
        try:
            with open(path, encoding="utf-8") as fh:
                marker = json.load(fh)
        except (OSError, ValueError):
            continue
        if session is None or marker.get("session") == session:
            markers.append(marker)
    return markers


def load_launcher_results(out_dir: str) -> list[dict]:
    results = []
    for path in sorted(glob.glob(os.path.join(out_dir, "launcher.*.json"))):
        try:
            with open(path, encoding="utf-8") as fh:
                results.append(json.load(fh))
        except (OSError, ValueError):
            continue
    return results


class RankTail:
    """Follows the rank files of a running job (for hang detection): new events as they are flushed."""

    def __init__(self, out_dir: str, session: str) -> None:
        self.out_dir = out_dir
        self.session = session
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}
        self.ranks: dict[int, dict] = {}        # rank -> meta
        self.last_progress: dict[int, float] = {}
        # When any rank first did something (a progress event, or was seen blocked in a collective):
        # the hang clock starts there, not at start-up, which can take long (DDP's first construction
        # imports torch._dynamo).
        self.first_activity: float | None = None
        self.last_events: dict[int, list] = {}  # rank -> last few events
        self.skip: set[str] = set()
        self.paths: dict[str, dict] = {}         # file -> its interned paths

    def poll(self, now: float) -> bool:
        """Read what was appended since the last poll; True when some rank made progress."""
        progressed = False
        for path in rank_files(self.out_dir):
            if path in self.skip:
                continue
            try:
                with open(path, "rb") as fh:
                    fh.seek(self.offsets.get(path, 0))
                    data = fh.read()
            except OSError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            data = self.partial.pop(path, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self.partial[path] = lines[-1]
            rank = None
            interned = self.paths.setdefault(path, {})
            for raw in lines[:-1]:
                try:
                    ev = json.loads(raw)
                    kind = ev[0]
                except (ValueError, TypeError, IndexError, KeyError):
                    continue
                if kind == F.PATH:
                    interned[ev[1]] = ev[2]
                    continue
                i = F.PATH_FIELD.get(kind)
                if i is not None and len(ev) > i and isinstance(ev[i], int):
                    ev[i] = interned.get(ev[i], ev[i])
                if ev[0] == R.META:
                    if ev[1].get("session") != self.session:
                        self.skip.add(path)
                        break
                    rank = ev[1]["rank"]
                    self.ranks[rank] = ev[1]
                    continue
                if rank is None:
                    rank = self._rank_of(path)
                    if rank is None:
                        break
                recent = self.last_events.setdefault(rank, [])
                recent.append(ev)
                del recent[:-8]
                if ev[0] in R.PROGRESS_KINDS or ev[0] == R.BLOCKED:
                    if self.first_activity is None:
                        self.first_activity = now
                if ev[0] in R.PROGRESS_KINDS:
                    self.last_progress[rank] = now
                    progressed = True
        return progressed

    def _rank_of(self, path: str) -> int | None:
        for rank, meta in self.ranks.items():
            if os.path.basename(path).endswith(f".{meta.get('pid')}.jsonl") and \
                    os.path.basename(path).startswith(f"rank-{rank:05d}."):
                return rank
        return None

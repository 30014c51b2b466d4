"""Reading the per-rank record files back (launcher and `synccheck report` side; no torch).

A record file may end in a half-written line (the rank was killed mid-write): that line is dropped,
everything before it is kept.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

from synccheck.profiler import recorder as R


@dataclass
class RankRecord:
    path: str
    meta: dict
    events: list = field(default_factory=list)
    truncated: bool = False

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])

    @property
    def pid(self) -> int:
        return int(self.meta.get("pid", 0))


def read_rank_file(path: str) -> RankRecord | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    events = []
    meta = None
    truncated = False
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            ev = json.loads(raw)
        except ValueError:
            truncated = True
            continue
        if not isinstance(ev, list) or not ev:
            continue
        if ev[0] == R.META and meta is None and isinstance(ev[1], dict):
            meta = ev[1]
        else:
            events.append(ev)
    if meta is None or "rank" not in meta:
        return None
    return RankRecord(path=path, meta=meta, events=events, truncated=truncated)


def read_meta(path: str) -> dict | None:
    """The meta record on a rank file's first line, without reading the rest (None until it is written)."""
    try:
        with open(path, "rb") as fh:
            ev = json.loads(fh.readline())
    except (OSError, ValueError):
        return None
    if isinstance(ev, list) and len(ev) == 2 and ev[0] == R.META and isinstance(ev[1], dict) \
            and "pid" in ev[1] and "rank" in ev[1]:
        return ev[1]
    return None


def rank_files(out_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(out_dir, "rank-*.jsonl")))


def load_ranks(out_dir: str, session: str | None = None) -> tuple[list[RankRecord], list[str]]:
    """Every rank found in `out_dir` (only `session`'s when given), one record per rank.

    A folder used by several runs can hold several files for one rank; the newest wins and a note says
    so. Returns (records sorted by rank, notes)."""
    notes: list[str] = []
    by_rank: dict[int, RankRecord] = {}
    duplicates = 0
    for path in rank_files(out_dir):
        record = read_rank_file(path)
        if record is None:
            continue
        if session is not None and record.meta.get("session") != session:
            continue
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
            for raw in lines[:-1]:
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
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

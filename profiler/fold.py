"""Folding a rank's events into optimizer-step windows (standard library only).

One state machine, used on both sides of the record file: the writer (recorder.py) folds every window it
buffers, to write one aggregate record for an ordinary optimizer step instead of its events; the reader
(summary.py) folds the events of the windows that were written in full. So an aggregate record says
exactly what its events would have said.

The unit is the **optimizer-step window**: the micro-steps, gradient all-reduces and collectives between
one optimizer step and the next. Several optimizers stepping back to back (a GAN, one optimizer per
module) are one boundary: a step with no micro-step since the previous step is merged into it.
"""
from __future__ import annotations

# Event kinds, as recorder.py writes them (first element of every record line).
META = "meta"       # ["meta", {...}]                                   once, first line
PATH = "path"       # ["path", id, "/abs/train.py"]                     before the first line using id
MODEL = "model"     # ["model", t, model_id, kind, n_params, n_bytes, path, line]
FORWARD = "fwd"     # ["fwd", t, model_id, synced, path, line]           one per micro-step
BUCKET = "bkt"      # ["bkt", t, dur, model_id, n_bytes, communicated]   one per DDP gradient bucket
COLLECTIVE = "coll"  # ["coll", t, dur, name, n_bytes, role, path, line]  Python-level collective
LATE_NO_SYNC = "late"  # ["late", t, model_id, how, path, line]          SC102 evidence
STEP = "step"       # ["step", t, n, optimizer_index, path, line, checksum]
BLOCKED = "blk"     # ["blk", t, name, path, line]                      written by the flusher thread
AGG = "agg"         # one ordinary optimizer-step window, folded (see Totals.to_agg)
PROG = "prog"       # the open window so far, folded: written instead of its events between steps

# Where each kind holds a source path (interned in the file as an integer id).
PATH_FIELD = {MODEL: 6, FORWARD: 4, COLLECTIVE: 6, LATE_NO_SYNC: 4, STEP: 4, BLOCKED: 3}
PROGRESS_KINDS = frozenset({FORWARD, BUCKET, COLLECTIVE, STEP, AGG, PROG})


class Totals:
    """What one window (or the open part of one) did, folded."""

    __slots__ = ("micro", "synced", "late", "n_ar", "ar_bytes", "ar_us", "last", "kinds", "sites", "colls",
                 "lates", "events")

    def __init__(self) -> None:
        self.micro = 0          # micro-steps (DDP/FSDP forwards with grad enabled)
        self.synced = 0         # ... whose backward all-reduced gradients
        self.late = 0           # synced forwards whose sync was switched off before the backward (SC102)
        self.n_ar = 0           # gradient all-reduces (DDP buckets, FSDP/manual gradient reductions)
        self.ar_bytes = 0
        self.ar_us = 0          # time those all-reduces were in flight
        self.last = None        # whether the last micro-step synced (None: no micro-step)
        self.kinds: dict = {}   # model kinds that ran a micro-step (an ordered set)
        self.sites: dict = {}   # (path, line) -> synced forwards there (every FSDP forward)
        self.colls: dict = {}   # (name, role) -> Python-level collectives ("hook" ones are not counted)
        self.lates: dict = {}   # (how, path, line) -> late no_sync evidence
        self.events = 0         # events folded in (0: nothing happened in this window yet)

    def signature(self, step) -> tuple:
        """Everything but time and checksum: windows with the same signature look alike."""
        return (self.micro, self.synced, self.late, self.n_ar, self.ar_bytes, self.last,
                tuple(self.kinds), tuple(self.sites.items()), tuple(self.colls.items()),
                tuple(self.lates.items()), step[3], step[4], step[5])

    def copy(self) -> Totals:
        t = Totals()
        for name in Totals.__slots__:
            value = getattr(self, name)
            setattr(t, name, dict(value) if isinstance(value, dict) else value)
        return t

    # -- the aggregate record -----------------------------------------------------------------------------
    # ["agg", t, n, optimizer_index, path, line, checksum,
    #  micro, synced, late, n_ar, ar_bytes, ar_us, last, "kind,kind", [[path, line, n]...],
    #  [[name, role, n]...], [[how, path, line, n]...]]
    # ["prog", t, <the same from micro on>]   (no step: the window is still open)

    def fields(self, intern) -> list:
        return [self.micro, self.synced, self.late, self.n_ar, self.ar_bytes, self.ar_us,
                None if self.last is None else int(self.last), ",".join(self.kinds),
                [[intern(p), line, n] for (p, line), n in self.sites.items()],
                [[name, role, n] for (name, role), n in self.colls.items()],
                [[how, intern(p), line, n] for (how, p, line), n in self.lates.items()]]

    @classmethod
    def from_fields(cls, f: list, path_of) -> Totals:
        t = cls()
        t.micro, t.synced, t.late, t.n_ar, t.ar_bytes, t.ar_us = f[0], f[1], f[2], f[3], f[4], f[5]
        if not all(type(v) is int for v in f[:6]):
            raise ValueError("not a record")
        t.last = None if f[6] is None else bool(f[6])
        t.kinds = dict.fromkeys(k for k in str(f[7]).split(",") if k)
        t.sites = {(path_of(p), line): n for p, line, n in f[8]}
        t.colls = {(name, role): n for name, role, n in f[9]}
        t.lates = {(how, path_of(p), line): n for how, p, line, n in f[10]}
        t.events = 1
        return t


def _add(d: dict, key, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


class Fold:
    """Feeds a rank's window events (in time order) into Totals; `feed` says when a step closes one."""

    def __init__(self) -> None:
        self.kinds: dict = {}          # model id -> kind
        self.win = Totals()
        self.fsdp_open: list | None = None   # [synced] of the FSDP micro-step whose backward runs now
        self.merge_next = False        # no micro-step since the last step: another step merges with it

    def _close_fsdp(self) -> None:
        if self.fsdp_open is not None:
            synced = self.fsdp_open[0]
            if synced:
                self.win.synced += 1
            self.win.last = synced
            self.fsdp_open = None

    def feed(self, ev: list):
        """None, or ("close", Totals, step event) when a step closes the window, or ("merge", step event)
        for a step merged into the previous one."""
        kind = ev[0]
        w = self.win
        if kind == FORWARD:
            self._close_fsdp()
            self.merge_next = False
            model_kind = self.kinds.get(ev[2], "ddp")
            w.events += 1
            w.micro += 1
            w.kinds[model_kind] = None
            if model_kind == "ddp":
                synced = bool(ev[3])
                w.last = synced
                if synced:
                    w.synced += 1
                    _add(w.sites, (ev[4], ev[5]))
            else:
                # FSDP reads its sync switch during backward: the micro-step synced if its backward reduced
                # gradients before the next forward or step.
                self.fsdp_open = [False]
                _add(w.sites, (ev[4], ev[5]))
        elif kind == BUCKET:
            w.events += 1
            dur, n_bytes, communicated = ev[2], ev[4], ev[5]
            if communicated:
                w.n_ar += 1
                w.ar_bytes += n_bytes
            if dur and dur > 0:
                w.ar_us += dur
        elif kind == COLLECTIVE:
            dur, name, n_bytes, role = ev[2], ev[3], ev[4], ev[5]
            if role == "hook":
                return None     # issued by a DDP comm hook: counted with its bucket
            w.events += 1
            _add(w.colls, (name, role))
            if role == "grad":
                w.n_ar += 1
                w.ar_bytes += n_bytes
                if dur and dur > 0:
                    w.ar_us += dur
                if self.fsdp_open is not None:
                    self.fsdp_open[0] = True
        elif kind == LATE_NO_SYNC:
            w.events += 1
            w.late += 1
            _add(w.lates, (ev[3], ev[4], ev[5]))
        elif kind == STEP:
            self._close_fsdp()
            if self.merge_next:
                return ("merge", ev)
            self.win = Totals()
            self.merge_next = True
            return ("close", w, ev)
        elif kind == MODEL:
            self.kinds[ev[2]] = ev[3]
        return None

    def close_with(self, totals: Totals, step: list) -> None:
        """An aggregate record closed a window that the file holds no events of."""
        if self.win.events:
            self.win = Totals()
        self.fsdp_open = None
        self.merge_next = True

    def snapshot(self) -> Totals:
        """The open window as it would close now (an FSDP micro-step in progress counted as it stands)."""
        t = self.win.copy()
        if self.fsdp_open is not None:
            if self.fsdp_open[0]:
                t.synced += 1
            t.last = self.fsdp_open[0]
        return t

"""Components analysed in other processes: in a process pool where there are enough of them to pay
for it; a large component alone in a forked child (where ``os.fork`` exists), which inherits the
files' texts (nothing is sent to it), sends back what the analysis returns (findings, errors,
counts) and exits at once, without freeing the trees it built (a second or more of a large
component's time).
"""
from __future__ import annotations

import os
import pickle
import selectors
import sys
from typing import Iterator, Optional

POOL_MIN_COMPONENTS = 4
APART_MIN_TEXT = 2_000_000      # characters of text: a component this large runs apart even alone
READ_APART_MIN_FILES = 400      # files to read: this many are read by several processes


def _usable_cpus() -> int:
    """The CPUs this process may run on: under ``taskset`` or a container's CPU set, os.cpu_count()
    counts the whole machine, and a worker per core there would only take turns on the few allowed."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):     # not on Linux
        return os.cpu_count() or 1


class _Pool:
    """Worker processes started on demand, only where enough components make them pay."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.executor = None

    def start(self) -> None:
        if self.executor is None and self.jobs > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor
            context = multiprocessing.get_context("fork") if hasattr(os, "fork") else None
            self.executor = ProcessPoolExecutor(max_workers=self.jobs, mp_context=context)

    def map(self, fn, work: list, sizes: Optional[list] = None) -> list:
        """``fn`` over ``work`` (largest first), the results in the same order: in the pool when it
        is started. Without one, an item whose text (``sizes``) is at least APART_MIN_TEXT runs in a
        forked child where more than one job is allowed (a fork per small component costs more than
        the pool's two workers)."""
        if self.executor is not None and len(work) >= 2:
            return list(self.executor.map(fn, work, chunksize=1))
        apart = self.jobs > 1 and hasattr(os, "fork") and sizes is not None
        return [run_forked(fn, [item], 1)[0] if apart and sizes[i] >= APART_MIN_TEXT else fn(item)
                for i, item in enumerate(work)]

    def read_all(self, fn, files: list, context) -> Iterator:
        """The (entry, error) of each file, in order: ``fn((files, context))`` -- split among forked
        children when the files are many and more than one job is allowed (reading and sorting the
        files of a large tree is a second of a lint of its own)."""
        if self.jobs <= 1 or not hasattr(os, "fork") or len(files) < READ_APART_MIN_FILES:
            return iter(fn((files, context)))
        jobs = self.jobs
        answers = run_forked(fn, [(files[k::jobs], context) for k in range(jobs)], jobs, warm=False)
        return (answers[i % jobs][i // jobs] for i in range(len(files)))     # dealt out in turn, read back so

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


def run_forked(fn, work: list, jobs: int, warm: bool = True) -> list:
    """``[fn(item) for item in work]``, each item in a forked child, ``jobs`` at a time. An exception
    ``fn`` raised is raised here (the first one, in the order of ``work``); an item whose child ended
    without an answer (killed, out of memory) is run here."""
    if warm:
        _warm()
    answers: list = [None] * len(work)
    todo = list(range(len(work)))
    running: dict = {}              # pipe fd -> (index, pid, chunks read)
    selector = selectors.DefaultSelector()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                index = todo.pop(0)
                fd, pid = _fork(fn, work[index])
                running[fd] = (index, pid, [])
                selector.register(fd, selectors.EVENT_READ)
            for key, _ in selector.select():
                fd = key.fd
                chunk = os.read(fd, 1 << 20)
                if chunk:
                    running[fd][2].append(chunk)
                    continue
                selector.unregister(fd)
                os.close(fd)
                index, pid, chunks = running.pop(fd)
                _reap(pid)
                answers[index] = pickle.loads(b"".join(chunks)) if chunks else None
    except BaseException:
        for fd, (_, pid, _) in running.items():
            _reap(pid, kill=True)
            os.close(fd)
        raise
    finally:
        selector.close()
    out = []
    for item, answer in zip(work, answers):
        if answer is None:
            out.append(fn(item))
            continue
        ok, value = answer
        if not ok:
            raise value
        out.append(value)
    return out


# what an analysis imports on its way: imported once here, before the children are forked, or each
# child would import (and, without bytecode files, compile) them again
_ANALYSIS_MODULES = ("synccheck.analyzer.parse", "synccheck.analyzer.project.program",
                     "synccheck.analyzer.project.syncflow", "synccheck.analyzer.project.static",
                     "synccheck.analyzer.project.rank_branches", "synccheck.analyzer.fix.plan",
                     "synccheck.analyzer.fix.plan_more")


def _warm() -> None:
    import importlib
    for name in _ANALYSIS_MODULES:
        importlib.import_module(name)


def _fork(fn, item) -> tuple:
    """(the read end of a pipe, the pid) of a child that writes ``fn(item)``'s outcome there and exits."""
    _flush()              # what this process buffered must not be written by the child too
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        return read_end, pid
    status = 0                                  # the child
    try:
        os.close(read_end)
        try:
            answer = (True, fn(item))
        except BaseException as exc:            # noqa: B902 - sent to the parent, raised there
            answer = (False, exc)
        try:
            payload = pickle.dumps(answer, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:                # an unpicklable result or exception
            payload = pickle.dumps((False, RuntimeError(f"analysis failed: {exc!r}")))
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        _flush()
    except BaseException:
        status = 1
    finally:
        os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _reap(pid: int, kill: bool = False) -> None:
    if kill:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    try:
        os.waitpid(pid, 0)
    except OSError:
        pass

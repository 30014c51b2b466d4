"""Issue 14: compact records, a streaming merge, a report for many ranks.

Most tests write rank files with the profiler's own writer (recorder.Recorder, fed the events its hooks
feed it) and read them back with the report's reader; the last ones run real 2-rank gloo jobs long enough
for the compact records to take over.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "profiler_scripts"))
import profiler_testlib as T  # noqa: E402

from synccheck.profiler import records, summary, verdict  # noqa: E402
from synccheck.profiler import recorder as R  # noqa: E402

SCRIPT = "/project/train.py"


def rank_steps(steps, *, mode="correct", micro=4, buckets=3, bucket_bytes=4000, bucket_us=500,
               anomaly_at=(), two_optimizers=False, eval_every=0, t0=1_000_000):
    """The events a rank's hooks hand the recorder, one list per optimizer step."""
    t = t0
    fsdp = mode.startswith("fsdp")
    yield [["model", t, "m0", "fsdp2" if fsdp else "ddp", 100, 400, SCRIPT, 10]]
    for n in range(1, steps + 1):
        evs = []
        k = micro + (1 if n in anomaly_at else 0)
        for i in range(k):
            t += 1000
            boundary = i == k - 1
            if mode in ("all_nosync", "local_sgd"):
                synced = False
            elif mode in ("every", "backward_only", "fsdp_every"):
                synced = True
            else:
                synced = boundary or n in anomaly_at and i == 0
            evs.append(["fwd", t, "m0", 1 if synced else 0, SCRIPT, 20])
            if fsdp:
                evs.append(["coll", t + 10, 50, "all_gather_into_tensor", 800, "gather", SCRIPT, 20])
                if synced:
                    for unit in range(2):
                        evs.append(["coll", t + 100 + unit, bucket_us, "reduce_scatter_single", bucket_bytes,
                                    "grad", SCRIPT, 21])
                continue
            if mode == "backward_only" and not boundary:
                evs.append(["late", t + 5, "m0", "no_sync", SCRIPT, 22])
            if synced:
                for b in range(buckets):
                    evs.append(["bkt", t + 100 + b * bucket_us, bucket_us, "m0", bucket_bytes, 1])
        if eval_every and n % eval_every == 0:
            evs.append(["coll", t + 300, 900, "barrier", 0, "other", SCRIPT, 30])
        t += 5000
        checksum = 7 if (n & (n - 1)) == 0 or n % 1024 == 0 else None
        evs.append(["step", t, n, 0, SCRIPT, 25, checksum])
        if two_optimizers:
            evs.append(["step", t + 1, n, 1, SCRIPT, 26, None])
        if mode == "local_sgd" and n % 2 == 0:
            evs.append(["coll", t + 50, 300, "all_reduce", 400, "avg", SCRIPT, 27])
        yield evs


def write_rank(folder, rank, steps_events, *, world=2, host="host0", full=False, session="s1", stop=None):
    """One rank file, written the way a profiled rank writes it: events, then a flush per optimizer step.
    `stop`: after that many steps, the events of a part of the next step and a flush between steps (as the
    background flusher does), then nothing (the rank was killed)."""
    os.makedirs(folder, exist_ok=True)
    rec = R.Recorder()
    rec.out_dir, rec.session, rec.full = str(folder), session, full
    assert rec._open(rank, world, "gloo", host=host, background=False)
    for n, evs in enumerate(steps_events):
        if stop is not None and n == stop + 1:
            for ev in evs:
                if ev[0] == "step":
                    break
                rec.event(ev)
            rec.flush()
            break
        for ev in evs:
            rec.event(ev)
        rec.flush()
    os.close(rec._fd)
    rec._fd, rec.active = None, False     # (a fork later must not close that number again)
    (path,) = [p for p in Path(folder).glob(f"rank-{rank:05d}.*.jsonl")]
    return path


def summarize_folder(folder):
    ranks, notes = records.load_ranks(str(folder))
    summaries, read_notes = summary.summarize_all(ranks, jobs=1)
    return summaries, notes + read_notes


def verdict_of(summaries):
    report = verdict.judge(summaries, [], len(summaries))
    return [(f.code, f.path, f.line, f.message, f.ranks) for f in report.findings]


SCENARIOS = {
    "correct": dict(mode="correct"),
    "every (SC101)": dict(mode="every"),
    "no_sync after the forward (SC102)": dict(mode="backward_only"),
    "no sync at all (SC103)": dict(mode="all_nosync"),
    "local SGD": dict(mode="local_sgd"),
    "FSDP every micro-step": dict(mode="fsdp_every"),
    "FSDP no_sync": dict(mode="fsdp_nosync"),
    "two optimizers, evaluation, odd steps": dict(mode="correct", two_optimizers=True, eval_every=7,
                                                  anomaly_at=(40, 41, 90)),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_compact_records_say_what_full_records_say(tmp_path, name):
    kwargs = SCENARIOS[name]
    steps = 120
    for rank in (0, 1):
        write_rank(tmp_path / "full", rank, rank_steps(steps, **kwargs), full=True)
        write_rank(tmp_path / "compact", rank, rank_steps(steps, **kwargs))
    full, _ = summarize_folder(tmp_path / "full")
    compact, _ = summarize_folder(tmp_path / "compact")
    for a, b in zip(full, compact):
        assert a.to_json() | {"pid": 0} == b.to_json() | {"pid": 0}
        assert a.windows == b.windows and len(a.windows) == steps
        assert a.steady == b.steady
    assert verdict_of(full) == verdict_of(compact)
    full_size = sum(p.stat().st_size for p in (tmp_path / "full").iterdir())
    compact_size = sum(p.stat().st_size for p in (tmp_path / "compact").iterdir())
    assert compact_size < full_size
    # ...and the compact files do hold aggregate records (the comparison is not between two full files)
    text = next((tmp_path / "compact").iterdir()).read_text()
    assert '["agg",' in text


def test_the_expected_verdicts_come_out_of_compact_records(tmp_path):
    codes = {}
    for name, mode in (("every", "every"), ("late", "backward_only"), ("none", "all_nosync"), ("ok", "correct")):
        for rank in (0, 1):
            write_rank(tmp_path / name, rank, rank_steps(100, mode=mode))
        summaries, _ = summarize_folder(tmp_path / name)
        codes[name] = sorted({code for code, *_ in verdict_of(summaries)})
        assert [s.optimizer_steps for s in summaries] == [100, 100]
        assert summaries[0].micro_steps == 400
    assert codes == {"every": ["SC101"], "late": ["SC102"], "none": ["SC103"], "ok": []}


def test_steady_state_is_under_300_bytes_per_step_whatever_the_buckets_and_micro_steps(tmp_path):
    steps = 300
    for buckets, micro in ((1, 1), (64, 16), (256, 8)):
        folder = tmp_path / f"b{buckets}-m{micro}"
        path = write_rank(folder, 0, rank_steps(100, mode="every", micro=micro, buckets=buckets))
        first = path.stat().st_size
        path.unlink()
        path = write_rank(folder, 0, rank_steps(steps, mode="every", micro=micro, buckets=buckets))
        per_step = (path.stat().st_size - first) / (steps - 100)
        assert per_step <= 300, (buckets, micro, per_step)
        (s,) = summarize_folder(folder)[0]
        assert s.grad_allreduces == steps * micro * buckets and s.synced_micro_steps == steps * micro


def test_warm_up_and_an_unusual_step_are_written_in_full(tmp_path):
    path = write_rank(tmp_path, 0, rank_steps(200, anomaly_at=(150,)))
    kinds_by_step, current = {}, []
    for line in path.read_text().splitlines():
        ev = json.loads(line)
        if ev[0] in ("step", "agg"):
            kinds_by_step[ev[2]] = ev[0]
        current.append(ev[0])
    assert all(kinds_by_step[n] == "step" for n in range(1, R.WARMUP_WINDOWS + 1))
    assert kinds_by_step[150] == "step"            # unlike the steps before it
    assert kinds_by_step[100] == "agg" and kinds_by_step[200] == "agg"
    (s,) = summarize_folder(tmp_path)[0]
    assert s.windows[149] == (5, 2) and s.windows[148] == (4, 1)
    # the path is written once, then referred to by number
    assert path.read_text().count(SCRIPT) == 1


def test_a_rank_killed_between_steps_keeps_what_it_did(tmp_path):
    write_rank(tmp_path / "a", 0, rank_steps(60), stop=50)
    (s,) = summarize_folder(tmp_path / "a")[0]
    # 50 whole steps, and the 4 micro-steps (one synced, 3 buckets) of the step it never finished
    assert s.optimizer_steps == 50 and s.micro_steps == 50 * 4 + 4
    assert s.synced_micro_steps == 51 and s.grad_allreduces == 51 * 3
    assert '["prog",' in next((tmp_path / "a").iterdir()).read_text()
    # killed mid-write: a partial last line is dropped, the rest used, and the report says which rank
    path = write_rank(tmp_path / "b", 1, rank_steps(60))
    with open(path, "ab") as fh:
        fh.write(b'["agg",123,61,0,0,25,null,4,1')
    write_rank(tmp_path / "b", 0, rank_steps(60))
    summaries, _ = summarize_folder(tmp_path / "b")
    assert [s.optimizer_steps for s in summaries] == [60, 60] and summaries[1].truncated
    report = verdict.judge(summaries, [], 2)
    assert any(n.startswith("rank 1: its record file ends in a partial line") for n in report.notes)


def test_progress_between_steps_is_one_line_at_most_every_few_seconds(tmp_path):
    rec = R.Recorder()
    rec.out_dir, rec.session = str(tmp_path), "s"
    assert rec._open(0, 1, "gloo", background=False)
    steps = list(rank_steps(R.WARMUP_WINDOWS + 20))
    for evs in steps[:R.WARMUP_WINDOWS + 11]:       # the model, then past the warm-up
        for ev in evs:
            rec.event(ev)
        rec.flush()
    (path,) = tmp_path.glob("rank-*.jsonl")
    partial = [ev for ev in steps[R.WARMUP_WINDOWS + 11] if ev[0] != "step"]

    def progs():
        return path.read_text().count('["prog",')

    rec.progress_interval_s = 3600
    rec.event(partial[0])
    rec.flush(background=True)              # the background flusher: once in a while only...
    rec.flush(background=True)
    assert progs() == 1
    rec.event(partial[1])
    rec.flush(background=True)
    assert progs() == 1
    rec.flush()                             # ...a barrier or destroy_process_group: at once, with what was held
    assert progs() == 2
    rec.progress_interval_s = 0
    for ev in partial[2:]:
        rec.event(ev)
        rec.flush(background=True)
    assert progs() == 2 + len(partial) - 2
    os.close(rec._fd)
    rec._fd, rec.active = None, False
    (s,) = summarize_folder(tmp_path)[0]
    assert s.optimizer_steps == R.WARMUP_WINDOWS + 10 and s.micro_steps == (R.WARMUP_WINDOWS + 11) * 4


def test_the_hang_watch_reads_compact_records(tmp_path):
    rec = R.Recorder()
    rec.out_dir, rec.session = str(tmp_path), "s"
    assert rec._open(0, 1, "gloo", background=False)
    tail = records.RankTail(str(tmp_path), "s")
    tail.poll(1.0)
    assert tail.first_activity is None
    for evs in rank_steps(R.WARMUP_WINDOWS + 5):
        for ev in evs:
            rec.event(ev)
        rec.flush()
    assert tail.poll(2.0) and tail.last_progress[0] == 2.0
    rec.event(["fwd", 10 ** 12, "m0", 0, SCRIPT, 20])     # a micro-step past the warm-up: a "prog" line
    rec.flush()
    assert tail.poll(3.0) and tail.last_events[0][-1][0] == "prog"
    rec.event(["blk", 10 ** 12 + 5, "barrier", SCRIPT, 40])
    rec.flush()
    assert not tail.poll(4.0)                              # blocked is not progress...
    assert tail.last_events[0][-1] == ["blk", 10 ** 12 + 5, "barrier", SCRIPT, 40]   # ...and names its line
    os.close(rec._fd)
    rec._fd, rec.active = None, False


def test_reading_a_long_file_holds_no_events(tmp_path):
    # A version-1 file (one line per event, as earlier synccheck wrote) of about 7 MB: read as a stream.
    folder = tmp_path / "v1"
    folder.mkdir()
    path = folder / "rank-00000.h.1.jsonl"
    steps = 20_000
    with open(path, "w") as fh:
        fh.write(json.dumps(["meta", {"version": 1, "rank": 0, "world_size": 1, "pid": 1, "host": "h", "t0": 0}]) + "\n")
        t = 1
        for n in range(1, steps + 1):
            lines = []
            for i in range(4):
                t += 10
                lines.append(f'["fwd",{t},"ddp0",{int(i == 3)},"{SCRIPT}",20]')
            for b in range(3):
                lines.append(f'["bkt",{t + 1 + b},5,"ddp0",4000,1]')
            t += 10
            lines.append(f'["step",{t},{n},0,"{SCRIPT}",25,null]')
            fh.write("\n".join(lines) + "\n")
    assert path.stat().st_size > 6e6
    (record,), _ = records.load_ranks(str(folder))
    tracemalloc.start()
    s = summary.summarize(record)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert s.optimizer_steps == steps and s.micro_steps == 4 * steps and s.grad_allreduces == 3 * steps
    assert peak < 2e6, peak       # 180,000 events would take about 50 MB


def _report(*args, timeout=120):
    return subprocess.run(T.synccheck_cmd("report", *args), capture_output=True, text=True, env=T.base_env(),
                          timeout=timeout)


def test_a_rank_file_of_a_newer_version_is_named_and_the_others_merged(tmp_path):
    write_rank(tmp_path, 0, rank_steps(20))
    newer = write_rank(tmp_path, 1, rank_steps(20))
    lines = newer.read_text().splitlines()
    meta = json.loads(lines[0])
    meta[1]["version"] = R.FORMAT_VERSION + 1
    newer.write_text("\n".join([json.dumps(meta)] + lines[1:]) + "\n")
    out = tmp_path / "r.json"
    proc = _report(str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    data = json.loads(out.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0]
    (note,) = [n for n in data["notes"] if "record version" in n]
    assert newer.name in note and f"record version {R.FORMAT_VERSION + 1}" in note and "rank 1 left out" in note
    assert "no records from rank(s) 1 of 2" in " ".join(data["notes"])
    # only files of an unknown version: one line, exit 2
    (tmp_path / os.path.basename(str(next(tmp_path.glob("rank-00000.*"))))).unlink()
    proc = _report(str(tmp_path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "record version" in proc.stderr and "Traceback" not in proc.stderr


def test_an_empty_folder_and_a_folder_of_unrelated_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _report(str(empty))
    assert proc.returncode == 2 and proc.stderr.strip().startswith("synccheck report: no rank records in")
    assert len(proc.stderr.strip().splitlines()) == 1
    junk = tmp_path / "junk"
    junk.mkdir()
    for i in range(10_000):
        (junk / f"file-{i}.txt").write_text("x")
    # ...some of them named like rank files, but not records; one named like a launcher file
    for i in range(50):
        (junk / f"rank-{i:05d}.jsonl").write_bytes(b"\x00garbage\n" * (i + 1))
    (junk / "launcher.x.json").write_text("{not json")
    started = time.perf_counter()
    proc = _report(str(junk))
    assert time.perf_counter() - started < 30
    assert proc.returncode == 2 and "no rank records in" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_a_huge_rank_file_is_streamed_in_bounded_memory(tmp_path):
    # Valid records, then 512 MB of a hole (NUL bytes, no newline: one "line" of 512 MB), then more records:
    # the over-long line is skipped piece by piece, never held whole.
    path = write_rank(tmp_path, 0, rank_steps(30))
    with open(path, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.truncate(fh.tell() + 512 * 2 ** 20)
        fh.seek(0, os.SEEK_END)
        fh.write(b"\n" + json.dumps(["fwd", 10 ** 9, "m0", 1, 0, 20]).encode() + b"\n")
    # the peak RSS of this process alone: VmHWM (ru_maxrss would carry the forking pytest's size over exec)
    code = ("import sys\nfrom synccheck.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]\n"
            "print('MAXRSS', hwm, file=sys.stderr)\n")
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-c", code, "report", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, env=T.base_env(), timeout=240)
    assert "Traceback" not in proc.stderr, proc.stderr
    maxrss_kb = int(proc.stderr.split("MAXRSS")[-1])
    assert maxrss_kb < 200 * 1024
    (rank,) = json.loads(out.read_text())["ranks"]
    assert rank["optimizer_steps"] == 30 and rank["micro_steps"] == 30 * 4 + 1 and rank["truncated"]


def test_many_ranks_collapse_into_groups_with_stragglers_and_nodes(tmp_path):
    world = 24
    for rank in range(world):
        kwargs = dict(mode="every", bucket_us=2000 if rank == 17 else 500)
        steps = 40 if rank == 5 else 80
        write_rank(tmp_path, rank, rank_steps(steps, **kwargs), world=world, host=f"node{rank // 8}")
    out = tmp_path / "r.json"
    proc = _report(str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stderr.split())
    data = json.loads(out.read_text())
    assert len(data["ranks"]) == world                                  # every rank's numbers
    groups = {g["ranks"]: g for g in data["groups"]}
    assert set(groups) == {"0-4,6-23", "5"} and groups["5"]["optimizer_steps"] == 40
    assert " 0-4,6-23 " in text and "rank 5 stopped early: 40 optimizer steps" in text
    assert [s["rank"] for s in data["stragglers"]] == [17]
    assert "stragglers, most time in all-reduce: rank 17 (node2)" in text
    assert [n["host"] for n in data["nodes"]] == ["node0", "node1", "node2"]
    assert "node node2: ranks 16-23" in text and "(slowest rank 17)" in text
    # SC101 with its value on this run: the all-reduce time the fix removes per step, and its share
    (f,) = data["findings"]
    assert f["code"] == "SC101" and f["ranks"] == list(range(world))
    assert "[ranks 0-23]" in text
    saving = f["saving"]
    # 4 synced micro-steps of 3 buckets per step: the fix keeps one of them
    assert saving["allreduce_s_per_step"] > 0 and 0 < saving["share_of_step"] < 1
    assert "the fix removes" in f["message"] and "of the" in f["message"]


def test_the_pool_reads_the_same_as_one_process(tmp_path, monkeypatch):
    for rank in range(10):
        write_rank(tmp_path, rank, rank_steps(50, mode="every" if rank % 3 else "correct"), world=10)
    ranks, _ = records.load_ranks(str(tmp_path))
    serial, _ = summary.summarize_all(ranks, jobs=1)
    monkeypatch.setattr(summary, "POOL_MIN_BYTES", 0)
    pooled, _ = summary.summarize_all(ranks, jobs=2)
    assert [s.to_json() for s in pooled] == [s.to_json() for s in serial]
    assert [s.rank for s in pooled] == list(range(10))


def test_a_folder_of_two_runs_uses_the_newest_file_of_each_rank(tmp_path):
    write_rank(tmp_path, 0, rank_steps(10), session="old")
    write_rank(tmp_path, 1, rank_steps(10), session="old")
    time.sleep(0.01)
    (tmp_path / "older").mkdir()
    for p in tmp_path.glob("rank-*.jsonl"):
        p.rename(tmp_path / "older" / p.name)
    write_rank(tmp_path, 0, rank_steps(20), session="new")
    write_rank(tmp_path, 1, rank_steps(20), session="new")
    for p in (tmp_path / "older").iterdir():
        p.rename(tmp_path / p.name.replace(".jsonl", "1.jsonl"))   # another pid, same rank
    summaries, notes = summarize_folder(tmp_path)
    assert [s.optimizer_steps for s in summaries] == [20, 20]
    assert any("more than one run" in n for n in notes)


# -- real jobs ---------------------------------------------------------------------------------------

ACCUM = T.script("accum.py")


@pytest.mark.multirank
def test_a_long_real_run_is_compact_and_counts_exactly(tmp_path):
    steps, micro = 40, 3
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "every", "--steps", str(steps)))
    assert run.returncode == 0, run.stderr
    for r in (0, 1):
        rank = run.rank(r)
        assert rank["optimizer_steps"] == steps and rank["micro_steps"] == steps * micro
        assert rank["synced_micro_steps"] == steps * micro and rank["grad_allreduces"] == steps * micro
        assert rank["grad_allreduce_bytes"] == steps * micro * (16 * 32 + 32 + 32 * 4 + 4) * 4
    assert run.codes() == ["SC101"] and "the fix removes" in run.finding("SC101")["message"]
    for path in run.out_dir.glob("rank-*.jsonl"):
        lines = path.read_text().splitlines()
        aggs = [line for line in lines if line.startswith('["agg",')]
        assert len(aggs) >= steps - R.WARMUP_WINDOWS - R.AFTER_REBUILD - 2
        assert max(len(line) for line in aggs) < 300


@pytest.mark.multirank
def test_a_rank_that_fails_after_the_warm_up_keeps_its_compact_steps(tmp_path):
    run = T.profile(tmp_path, T.torchrun(ACCUM, "--mode", "correct", "--steps", "30", "--raise-after", "20",
                                         "--raise-rank", "1"))
    assert run.returncode == 1, run.stderr
    assert run.rank(1)["optimizer_steps"] == 20 and run.rank(1)["micro_steps"] >= 60
    records = T.read_records(run.out_dir)
    assert T.count(records[1], "agg") >= 20 - R.WARMUP_WINDOWS - R.AFTER_REBUILD - 2

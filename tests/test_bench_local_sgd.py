"""benchmarks/bench_local_sgd.py, run for real on two gloo ranks in a tiny configuration.

Not a timing test: it checks what the K-batch table is built from. Both schemes train, every run
leaves the ranks with identical parameters, local SGD with K = 1 is the same optimization as full
synchronous SGD (SGD with momentum is linear in the gradient, so averaging parameters after every
local step equals stepping on the averaged gradient), accumulation makes N times fewer updates, and
the printed table has every scheme and every K.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    # A plain import (not a file-location import): mp.spawn's children re-import the module that
    # defines the worker by name, with the parent's sys.path.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("bench_local_sgd")
    finally:
        sys.path.remove(str(BENCHMARKS))


TINY = ["--samples", "512,1024", "--epochs", "2", "--ks", "1,4", "--seeds", "1"]


@pytest.fixture(scope="module")
def tiny(bench):
    args = bench.parse_args(TINY)
    runs = bench.run_ranks(args)
    return args, runs, bench.summarize(runs)


@pytest.mark.multirank
def test_rows_have_one_cell_per_samples_scheme_and_k(tiny):
    _, runs, rows = tiny
    assert len(runs) == 2 * 2 * 2  # samples x schemes x ks, one seed
    assert [(row["samples"], row["scheme"], row["k"]) for row in rows] == [
        (samples, scheme, k) for samples in (512, 1024) for scheme in ("accumulate", "local_sgd") for k in (1, 4)]
    for row in rows:
        assert row["seeds"] == [0]
        assert 0.0 <= row["accuracy"] <= 1.0
        assert row["seconds"] > 0
        assert row["speedup_vs_full_sync"] > 0 and row["speedup_vs_k1"] > 0
        if row["k"] == 1:
            assert row["speedup_vs_k1"] == 1.0
        if (row["scheme"], row["k"]) == ("accumulate", 1):
            assert row["speedup_vs_full_sync"] == 1.0


@pytest.mark.multirank
def test_both_schemes_learn_and_update_as_often_as_they_should(tiny):
    args, runs, rows = tiny
    for run in runs:
        batches = run["samples"] // (args.ranks * args.batch) * args.epochs
        if run["scheme"] == "accumulate":
            assert run["updates"] == batches // run["k"]
            assert run["lr"] == pytest.approx(args.lr * run["k"])  # the linear rule
        else:
            assert run["updates"] == batches
            assert run["lr"] == args.lr
        # every run ends with the ranks holding bit-identical parameters: DDP's synchronous steps,
        # or LocalSGD's averaging after the last period
        assert run["ranks_identical"], run
    chance = 1 / 8
    for row in rows:
        if row["k"] == 1:
            assert row["accuracy"] > 1.5 * chance, row


@pytest.mark.multirank
def test_local_sgd_every_batch_equals_full_sync(tiny):
    args, runs, _ = tiny
    by_key = {(run["samples"], run["scheme"], run["k"], run["seed"]): run for run in runs}
    for samples in args.samples:
        full = by_key[(samples, "accumulate", 1, 0)]
        local = by_key[(samples, "local_sgd", 1, 0)]
        assert local["test_loss"] == pytest.approx(full["test_loss"], rel=1e-4)
        assert abs(local["accuracy"] - full["accuracy"]) <= 1 / 4096 * 2
        # and K = 4 is a different optimization (otherwise the comparison above proves nothing)
        assert by_key[(samples, "local_sgd", 4, 0)]["test_loss"] != pytest.approx(full["test_loss"], rel=1e-4)


@pytest.mark.multirank
def test_the_printed_table_has_every_scheme_and_k(bench, tiny):
    args, _, rows = tiny
    text = bench.table(rows, args)
    wide = text.split("mean ± standard deviation")[0]
    header = next(line for line in wide.splitlines() if "N/K=1" in line)
    assert header.split()[-2:] == ["N/K=1", "4"]
    for title in bench.SCHEME_TITLES.values():
        assert sum(line.startswith(title) for line in wide.splitlines()) == len(args.samples)
    detail = [line.split() for line in text.splitlines() if line.strip().split(" ")[0] in ("512", "1,024")]
    assert [(line[0], line[1], line[2]) for line in detail] == [
        (f"{row['samples']:,}", row["scheme"], str(row["k"])) for row in rows]
    for line, row in zip(detail, rows):
        assert line[5] == f"{row['accuracy']:.3f}"


def test_schedule_interleaves_every_cell_once(bench):
    args = bench.parse_args(["--samples", "512,1024", "--ks", "1,2,4,8,16", "--seeds", "3"])
    order = bench.schedule(args)
    cells = {(samples, scheme, k, seed) for samples in (512, 1024) for scheme in bench.SCHEMES
             for k in (1, 2, 4, 8, 16) for seed in range(3)}
    assert sorted(order) == sorted(cells)
    # seeds are rounds: all of seed 0, then seed 1, ...; inside a round the schemes alternate who goes
    # first and the K order rotates, so neither scheme always runs in the same slot
    assert [seed for *_, seed in order] == sorted(seed for *_, seed in order)
    first = [order[i][1] for i in range(0, len(order), 2)]
    assert first.count("accumulate") and first.count("local_sgd")
    assert order[0][2] != order[len(order) // 3][2]


def test_summary_speedups_are_time_ratios(bench):
    runs = [{"samples": 64, "scheme": scheme, "k": k, "seed": seed, "seconds": seconds, "accuracy": 0.5,
             "cpu_seconds": seconds / 2, "updates": 1, "lr": 0.1}
            for scheme, k, seed, seconds in [("accumulate", 1, 0, 4.0), ("accumulate", 1, 1, 6.0),
                                             ("accumulate", 2, 0, 2.0), ("accumulate", 2, 1, 3.0),
                                             ("local_sgd", 1, 0, 10.0), ("local_sgd", 1, 1, 10.0),
                                             ("local_sgd", 2, 0, 1.0), ("local_sgd", 2, 1, 4.0)]]
    rows = {(row["scheme"], row["k"]): row for row in bench.summarize(runs)}
    assert rows[("accumulate", 1)]["seconds"] == 5.0
    assert rows[("accumulate", 2)]["speedup_vs_k1"] == pytest.approx(2.0)
    assert rows[("local_sgd", 1)]["speedup_vs_full_sync"] == pytest.approx(0.5)
    assert rows[("local_sgd", 2)]["speedup_vs_k1"] == pytest.approx(4.0)
    assert rows[("local_sgd", 2)]["speedup_vs_full_sync"] == pytest.approx(2.0)
    assert rows[("local_sgd", 2)]["cpu_speedup_vs_full_sync"] == pytest.approx(2.0)
    assert rows[("local_sgd", 2)]["seconds_std"] == pytest.approx(2.1213, abs=1e-4)


def test_bad_arguments_are_refused(bench):
    for argv in (["--ks", "0,2"], ["--samples", "16"], ["--seeds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    assert bench.parse_args(["--quick"]).seeds == 3
    assert isinstance(bench.parse_args([]), argparse.Namespace)

"""Every rule's own VALID and INVALID examples are test cases (Fixit's idea: one source, three uses)."""
import textwrap

import pytest

from synccheck.analyzer.engine import check_source
from synccheck.analyzer.rules import ALL_RULES, Rule

CASES = [(rule, kind, i, src) for rule in ALL_RULES
         for kind, examples in (("valid", rule.VALID), ("invalid", rule.INVALID))
         for i, src in enumerate(examples)]


@pytest.mark.parametrize("rule,kind,index,source", CASES,
                         ids=[f"{r.code}-{k}-{i}" for r, k, i, _ in CASES])
def test_rule_example(rule, kind, index, source):
    source = textwrap.dedent(source).lstrip("\n")
    found = check_source(source, "example.py")
    got = {(f.line, f.code) for f in found if f.code == rule.code}
    if kind == "valid":
        assert got == set(), f"{rule.code} fired on its own valid example {index}: {found}"
    else:
        expected = {(line, code) for line, code in Rule.expected_lines(source) if code == rule.code}
        assert expected, "an invalid example must mark at least one line"
        assert got == expected, "\n".join(f"{f.line}:{f.column} {f.code} {f.message}" for f in found)


def test_every_rule_has_examples_and_docs():
    for rule in ALL_RULES:
        assert rule.INVALID, rule.code
        doc = rule.documentation()
        for heading in ("## What it does", "## Why is this bad?", "## Example"):
            assert heading in doc, (rule.code, heading)


def test_sc301_collective_prefilter_matches_the_regex():
    # SC301's cheap file filter finds collectives with str.find; it must agree with the rule's regex
    from synccheck.analyzer.rules.sc301 import COLLECTIVE_CALL, _has_collective
    cases = ["dist.barrier()", "xdist.barrier()", "_dist.all_reduce(x)", "torch.distributed.all_reduce(t)",
             "accelerator.wait_for_everyone()", "c10d.broadcast_object_list(x)", "dist.barrier ()",
             "dist.reduce(", "dist.reduced(", "dist.reduce_scatter_tensor(", "fabric.barrier()",
             "x = 1\nif rank == 0:\n    dist.gather(t)\n", "print('dist.')", "dist.", ""]
    for text in cases:
        assert _has_collective(text) == (COLLECTIVE_CALL.search(text) is not None), text


SC301_HELPERS = {
    # the collective after a signature wrapped the way black writes it
    "wrapped": '''
        def sync_metrics(
            t,
        ):
            dist.all_reduce(t)
    ''',
    # through a second helper, in a call cycle that is met before the collective
    "cycle": '''
        def report(t):
            return log(t) or sync(t)

        def log(t):
            return report(t) if t is None else t

        def sync(t):
            dist.all_reduce(t)
    ''',
    # a docstring whose lines are not indented comes first
    "docstring": 'def sync_metrics(t):\n    """Sum over ranks.\nNot indented.\n"""\n    dist.all_reduce(t)\n',
    "one_line": '''
        def sync_metrics(t): dist.all_reduce(t)
    ''',
}


@pytest.mark.parametrize("kind", sorted(SC301_HELPERS))
def test_sc301_follows_the_rank_branch_into_a_helper(kind):
    from synccheck.analyzer.rules.sc301 import CollectiveInRankBranch

    entry = "log" if kind == "cycle" else "sync_metrics"
    source = "import torch.distributed as dist\n" + textwrap.dedent(SC301_HELPERS[kind]) + \
        f"\nif dist.get_rank() == 0:\n    {entry}(loss)\n"
    assert CollectiveInRankBranch.wants(source)
    found = [f for f in check_source(source, "s.py") if f.code == "SC301"]
    assert [f.line for f in found] == [source.count("\n")], found


def test_sc301_never_parses_a_file_whose_rank_branches_call_no_collective():
    # torch's RPC tests: `if self.rank == 0:` blocks call many helpers, none of which runs a collective
    from synccheck.analyzer.rules.sc301 import CollectiveInRankBranch

    source = textwrap.dedent('''
        import torch.distributed as dist

        def check(t):
            return t.sum()

        def finish():
            dist.barrier()

        if dist.get_rank() == 0:
            check(loss)
        finish()
    ''')
    assert not CollectiveInRankBranch.wants(source)
    assert CollectiveInRankBranch.wants(source.replace("    check(loss)", "    finish()"))

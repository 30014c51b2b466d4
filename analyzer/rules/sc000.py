from synccheck.analyzer.rules.base import Rule


class ParseError(Rule):
    code = "SC000"
    name = "parse-error"
    severity = "error"
    summary = "The file cannot be parsed as Python 3"
    what = """
        Reports a file that is not valid Python 3 (a syntax error, Python 2 code, a truncated file).
        The file is reported, never skipped silently, and the other files are still checked. It
        applies to the files some rule needs to parse: each rule first looks for the words and calls
        it works on (a `.backward(` call *and* an optimizer step, `no_sync`, a collective beside a
        rank test, ...), and a file none of them wants is never parsed, which is what keeps synccheck
        fast on large code bases. A broken file that no rule would analyse is not reported.
    """
    why = """
        A file synccheck cannot parse is a file nothing checks: its training loop could waste every
        all-reduce or leave the ranks diverged and you would not know.
    """
    use_instead = "Fix the syntax error; Python 2 scripts need porting (`print(x)`, not `print x`)."
    INVALID = ("""
        for step, batch in enumerate(loader):
            print "step", step  # SC000
            model.require_backward_grad_sync = True
            loss.backward()
    """,)

from synccheck.analyzer.rules.base import Rule


class ParseError(Rule):
    code = "SC000"
    name = "parse-error"
    severity = "error"
    summary = "The file cannot be parsed as Python 3"
    what = """
        Reports a file that is not valid Python 3 (a syntax error, Python 2 code, a truncated file).
        The file is reported, never skipped silently, and the other files are still checked. Like
        every rule it applies to files that mention training (`backward`, `no_sync`, ...): files that
        do not are never parsed, which is what keeps synccheck fast on large code bases.
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

"""Autofix: ``synccheck lint --fix``.

A rule that can prove its rewrite attaches a *plan* to its finding: a few operations on statements
and expressions of the file (wrap these statements in a ``with``, insert this line before the
forward, move this call), located by the positions the training-loop model recorded. ``plan.py``
turns the model's facts into plans, ``rewrite.py`` carries them out on a libcst tree (which keeps
comments, formatting and the file's line endings) and reports the result as ruff-style text edits;
``apply.py`` checks and writes them (``--fix``, ``--diff``). Nothing here imports torch or runs the
code it rewrites.
"""

# Whether plan.build renders a fix's edits. A plain lint (engine.lint(edits=False)) only needs to know
# that a fix exists and how safe it is, for "N fixable with --fix" and the "[*]" line: the libcst parse
# and rewrite are left to --fix, --diff and --format json, which analyse again or ask for the edits.
EDITS = True

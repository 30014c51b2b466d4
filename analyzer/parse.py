"""Stage 3: parse with libcst (imported here, lazily: only when some file needs a parse)."""
from __future__ import annotations

from typing import Tuple


def parse(text: str) -> Tuple[object, object]:
    """(module, None) or (None, (line, column, message)) -- a parse error is a finding, not a crash."""
    import libcst as cst

    try:
        return cst.parse_module(text), None
    except cst.ParserSyntaxError as exc:
        line, column, message = exc.raw_line, exc.raw_column + 1, "invalid syntax"
    except (RecursionError, MemoryError) as exc:
        return None, (1, 1, f"too deeply nested to analyse ({type(exc).__name__})")
    except Exception as exc:   # libcst raises a few other types on odd input (e.g. mixed tabs)
        line, column, message = 1, 1, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None, syntax_error(text) or (line, column, message)


def syntax_error(text: str):
    """CPython's own message, the one users know ("Missing parentheses in call to 'print'...").

    Also the cheap check for files no rule needs a tree of: compile() is ~10x faster than libcst.
    """
    try:
        compile(text, "<synccheck>", "exec", dont_inherit=True, flags=1024)   # ast.PyCF_ONLY_AST
    except SyntaxError as err:
        return (err.lineno or 1, max(err.offset or 1, 1), err.msg or "invalid syntax")
    except (ValueError, RecursionError, MemoryError) as exc:
        return (1, 1, str(exc) or type(exc).__name__)
    return None

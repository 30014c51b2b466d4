"""Source snippets in `synccheck lint`'s full format: long lines are cut around the reported span (as
ruff does), and the caret stays under the reported column with tabs, wide characters and control
characters on the line."""
from __future__ import annotations

import os
import subprocess
import sys

from rich.cells import cell_len

from synccheck.analyzer.ftypes import Finding
from synccheck.analyzer.report import CUT, snippet

from lintlib import BAD_LOOP


def finding(line: int, column: int, end_column: int, end_line: int | None = None) -> Finding:
    return Finding("SC101", "sync-every-microstep", "warning", "t.py", line, column,
                   end_line or line, end_column, "message")


def under_caret(text: str, at: int, length: int) -> str:
    """The characters of a shown line that occupy terminal cells [at, at + length)."""
    out, cell = [], 0
    for ch in text:
        if at <= cell < at + length:
            out.append(ch)
        cell += cell_len(ch)
    return "".join(out)


def span_of(line: str, needle: str) -> tuple[int, int]:
    start = line.index(needle) + 1
    return start, start + len(needle)


def test_short_lines_are_shown_whole():
    lines = ["for x in loader:", "    loss.backward()"]
    shown, (at, length) = snippet(lines, finding(2, *span_of(lines[1], "loss.backward()")), 140)
    assert shown == [(1, lines[0]), (2, lines[1])]
    assert (at, length) == (4, len("loss.backward()"))


def test_a_900_character_line_is_cut_around_the_span():
    line = "    x = '" + "a" * 450 + "'; loss.backward(); y = '" + "b" * 420 + "'"
    assert len(line) > 900
    lines = ["    z = '" + "c" * 880 + "'", line]
    shown, (at, length) = snippet(lines, finding(2, *span_of(line, "loss.backward()")), 100)
    for _, text in shown:
        assert cell_len(text) <= 100 and text.startswith(CUT) and text.endswith(CUT)
    assert under_caret(shown[1][1], at, length) == "loss.backward()"
    # the span sits near the middle of the window, with context on both sides
    assert 30 < at < 60


def test_a_span_near_the_end_is_cut_on_the_left_only():
    line = "    x = '" + "a" * 900 + "'; loss.backward()"
    shown, (at, length) = snippet([line], finding(1, *span_of(line, "loss.backward()")), 80)
    ((_, text),) = shown
    assert text.startswith(CUT) and text.endswith("loss.backward()") and cell_len(text) <= 80
    assert under_caret(text, at, length) == "loss.backward()"


def test_a_span_at_the_start_is_cut_on_the_right_only():
    line = "loss.backward(); x = '" + "a" * 900 + "'"
    shown, (at, length) = snippet([line], finding(1, *span_of(line, "loss.backward()")), 80)
    ((_, text),) = shown
    assert text.startswith("loss.backward(); x = 'aaa") and text.endswith(CUT) and cell_len(text) <= 80
    assert (at, length) == (0, len("loss.backward()"))


def test_a_span_wider_than_the_window_starts_the_window():
    line = "    y = f(" + ", ".join(f"arg{i}" for i in range(200)) + ")"
    start = line.index("f(") + 1
    shown, (at, length) = snippet([line], finding(1, start, len(line) + 1), 60)
    ((_, text),) = shown
    assert cell_len(text) <= 60
    assert under_caret(text, at, length).startswith("f(arg0, arg1")
    assert at + length == cell_len(text) - len(CUT)          # the caret runs to the cut


def test_tabs_wide_characters_and_control_characters_keep_the_caret_in_place():
    # libcst columns count characters; the terminal shows a tab as several cells, a CJK character as 2
    line = "\tname = '日本語\x1b[31m'; loss.backward()"
    shown, (at, length) = snippet([line], finding(1, *span_of(line, "loss.backward()")), 140)
    ((_, text),) = shown
    assert "\t" not in text and "\x1b" not in text and "\u241b" in text     # ESC shown as its picture
    assert under_caret(text, at, length) == "loss.backward()"
    # the same line made long enough to be cut: still under the span
    long_line = "\tname = '日本語" * 60 + "'; loss.backward()"
    shown, (at, length) = snippet([long_line], finding(1, *span_of(long_line, "loss.backward()")), 70)
    ((_, text),) = shown
    assert cell_len(text) <= 70 and under_caret(text, at, length) == "loss.backward()"


def test_every_line_shown_uses_the_same_window():
    previous = "    " + "".join(f"{i:04d}" for i in range(250))
    line = "    " + "".join(f"{i:04d}" for i in range(120)) + "loss.backward()" + "0" * 400
    shown, (at, length) = snippet([previous, line], finding(2, *span_of(line, "loss.backward()")), 90)
    (_, above), (_, text) = shown
    assert under_caret(text, at, length) == "loss.backward()"
    # columns line up: the 4-digit counters before the span read the same in both lines
    assert above[:at] == text[:at]


def test_lint_output_has_no_line_longer_than_the_window(tmp_path):
    pad = "x" * 900
    source = BAD_LOOP.replace("loss.backward()", f"note = '{pad}'; loss.backward()")
    assert source != BAD_LOOP
    (tmp_path / "train.py").write_text(source)
    env = {**os.environ, "SYNCCHECK_DEBUG": ""}
    env.pop("COLUMNS", None)
    proc = subprocess.run([sys.executable, "-m", "synccheck", "lint", "--no-cache", "train.py"],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr
    snippet_lines = [line for line in proc.stdout.splitlines() if " | " in line]
    assert snippet_lines and all(len(line) <= 140 for line in snippet_lines), snippet_lines
    source_line, caret_line = snippet_lines[-2], snippet_lines[-1]
    assert source_line[caret_line.index("^"):caret_line.rindex("^") + 1] == "loss.backward()"

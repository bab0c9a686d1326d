from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TEST_DATA = ROOT / "tests" / "data"  # the fixtures beside the tests, whichever folder a test is in


def error_lines(stderr: str) -> list[str]:
    """The testbed's one-line errors in a process's stderr. A library's exit message without a
    final newline (nanobind's leak report) can run into the next line, so an error is found where
    it begins, not only at a line's start."""
    return [line[line.index("error: ") :] for line in stderr.splitlines() if "error: " in line]

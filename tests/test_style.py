"""The tree's line-length limit, checked on the source: no line of a .py file under kvpp_fx/, tests/ or
benchmarks/ is longer than 120 characters, except the lines of the golden graph dumps (the multi-line
strings of `GOLDEN_FILES`), which are the graphs exactly as they print."""

import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 120
CHECKED = ("kvpp_fx", "tests", "benchmarks")
GOLDEN_FILES = ("tests/passes/test_golden.py",)


def golden_lines(source: str) -> set[int]:
    """The numbers of the lines inside a multi-line string literal of `source`: every line after the one
    that opens it, up to the one that closes it (the opening line holds code)."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and token.end[0] > token.start[0]:
            lines.update(range(token.start[0] + 1, token.end[0] + 1))
    return lines


def long_lines(path: Path, goldens: bool = False) -> list[tuple[int, int]]:
    """(line number, length) of each line of `path` over `MAX_LINE` characters; with `goldens`, not those
    inside a multi-line string (`golden_lines`)."""
    source = path.read_text()
    skipped = golden_lines(source) if goldens else set()
    return [(number, len(line)) for number, line in enumerate(source.splitlines(), start=1)
            if len(line) > MAX_LINE and number not in skipped]


def test_no_line_is_longer_than_120_characters():
    found = []
    for top in CHECKED:
        for path in sorted((ROOT / top).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            found += [f"{name}:{number}: {length} characters"
                      for number, length in long_lines(path, goldens=name in GOLDEN_FILES)]
    assert not found, f"lines over {MAX_LINE} characters:\n" + "\n".join(found)


def test_the_checker_reports_a_long_line_and_not_a_golden_one(tmp_path):
    """The control: a 121-character line is reported, one inside a golden string is not (and is without
    `goldens`), and a line of exactly 120 characters is not."""
    planted = tmp_path / "planted.py"
    long_code = "x = '" + "a" * 115 + "'"
    golden_text = "b" * 121
    planted.write_text("\n".join([
        "y = '" + "c" * 114 + "'",
        long_code,
        'GOLDEN = """\\',
        golden_text,
        '"""',
        "",
    ]))
    assert (len(long_code), len(golden_text)) == (121, 121)
    assert long_lines(planted, goldens=True) == [(2, 121)]
    assert long_lines(planted) == [(2, 121), (4, 121)]


MAX_TEST_FILE_LINES = 800


def long_files(top: Path) -> list[str]:
    """Each .py file under `top` longer than `MAX_TEST_FILE_LINES` lines, with its count."""
    return [f"{path.relative_to(top).as_posix()}: {count} lines" for path in sorted(top.rglob("*.py"))
            if (count := len(path.read_text().splitlines())) > MAX_TEST_FILE_LINES]


def test_no_test_file_is_longer_than_800_lines():
    """A test module over 800 lines is split by concern (the vLLM cases and engine tests are)."""
    assert long_files(ROOT / "tests") == []


def test_the_file_length_check_finds_a_long_file(tmp_path):
    """The control: a file of 801 lines is found, one of 800 is not."""
    (tmp_path / "long.py").write_text("x = 1\n" * 801)
    (tmp_path / "fits.py").write_text("x = 1\n" * 800)
    assert long_files(tmp_path) == ["long.py: 801 lines"]

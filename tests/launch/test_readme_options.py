"""README.md's options table is the generated one (launch.options.markdown_table()).

NOTE (issue 26): this test fails until README.md holds the table between the lines `<!-- options:begin -->` and
`<!-- options:end -->`; the coordinator inserts it after merging (README.md belongs to the docs helper).
Regenerate it with `python -m launch.cli --options-table`.
"""
from __future__ import annotations

from pathlib import Path

from launch.options import markdown_table

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"


def test_readme_options_table_is_the_generated_one():
    lines = README.read_text().splitlines()
    assert BEGIN in lines and END in lines, (f"README.md has no {BEGIN} ... {END} lines; put the output of "
                                             f"`python -m launch.cli --options-table` between them")
    between = "\n".join(lines[lines.index(BEGIN) + 1:lines.index(END)]).strip("\n")
    assert between == markdown_table().strip("\n"), ("README.md's options table is stale: replace it with the "
                                                     "output of `python -m launch.cli --options-table`")

"""docs/tensorrt-llm.md shows the option mapping the code applies (mapping.py renders it)."""

from __future__ import annotations

from pathlib import Path

from trtforge.model_repo.trtllm.mapping import mapping_table_markdown

DOC = Path(__file__).resolve().parents[3] / "docs" / "tensorrt-llm.md"


def test_the_docs_table_is_the_code_table():
    text = DOC.read_text()
    start = text.index("<!-- mapping table:")
    table = text[text.index("\n", start) + 1:text.index("<!-- end of mapping table -->")].strip()
    assert table == mapping_table_markdown(), "regenerate the table with mapping_table_markdown()"

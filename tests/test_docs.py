"""The project's docs stay true: the README's generated tables are those of the code."""
from pathlib import Path

import pytest

from cupycomm._docs import call_table, dtype_table, variable_table

README = Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.parametrize("table", [dtype_table, call_table, variable_table])
def test_readme_tables_are_generated_from_the_code(table):
    assert table() in README.read_text(), (
        f"README.md's {table.__name__} is stale; paste the output of python -m cupycomm._docs "
        f"there")

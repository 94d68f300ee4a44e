"""The project's docs stay true: the README's dtype table is the one in cupycomm._dtypes."""
from pathlib import Path

from cupycomm._docs import dtype_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_dtype_table_is_generated_from_the_table():
    assert dtype_table() in README.read_text(), (
        "README.md's dtype table is stale; paste the output of python -m cupycomm._docs there")

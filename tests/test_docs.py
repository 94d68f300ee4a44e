"""The project's docs stay true: the generated tables are those of the code, and every Python
snippet of README.md and docs/ runs as its first line says.

A snippet's first line says how it runs, and the test runs it so (in a temporary directory,
under the file name given):

- ``# mpiexec -n 2 python name.py``: on 2 ranks (``run_mpiexec``); MPICH's
  ``-disable-auto-cleanup`` before ``-n`` becomes :func:`no_auto_cleanup`'s options;
- ``# mpiexec -n 2 python -m pytest test_name.py``: a test file run by pytest on 2 ranks;
- ``# python name.py``: one process, no launcher;
- ``# needs a GPU: <one of the above>`` (or ``# needs 2 GPUs: ...``): not run here (CI has
  no GPU), only compiled.

A snippet that pytest does not run, and the README's self-check, run where pytest cannot be
imported (:func:`without_pytest`): the README's first command installs no test extra, so
what it documents must work without it.

A Python snippet without such a line fails the test: every snippet either runs or says why
it cannot. Shell blocks are commands to type, not run by this test, except the README's
self-check.
"""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cupycomm.tools.docs import call_table, dtype_table, launcher_table, variable_table
from cupycomm.testing import launch_environment, no_auto_cleanup, run_job, run_mpiexec

pytestmark = pytest.mark.mpi(max_size=1)   # the snippets start jobs of their own

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README] + sorted(p for p in (ROOT / "docs").rglob("*.md")
                                      if "_build" not in p.parts)
TIMEOUT = 120
# What the getting-started page installs holds no pytest: a module of this name, first on the
# path, that cannot be imported stands for its absence (in the ranks too, which inherit it).
NO_PYTEST = "raise ModuleNotFoundError(\"No module named 'pytest'\", name=__name__)\n"

HEADER = re.compile(r"# (?P<gpu>needs (?:a GPU|\d+ GPUs): )?"
                    r"(?:mpiexec (?P<options>(?:-\S+ )*)-n (?P<n>\d+) )?"
                    r"python (?P<args>\S.*?)\s*$")
DOC_EXAMPLE = re.compile(r"^(?P<indent> *)Example \((?P<n>\d+) ranks\)::$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


def snippets(page):
    """(line number, info string, text) of each fenced code block of a Markdown page."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, start = opening["fence"], i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        yield start, opening["info"].strip(), "\n".join(lines[start:i]) + "\n"
        i += 1


def python_snippets():
    for page in PAGES:
        for line, info, text in snippets(page):
            if info == "python":
                yield pytest.param(text, id=f"{page.relative_to(ROOT)}:{line}")


def without_pytest(directory):
    """The variables under which no process can import pytest (a ``pytest`` and a
    ``_pytest`` in ``directory``, first on the path, that raise as a missing one does)."""
    (directory / "pytest.py").write_text(NO_PYTEST)
    (directory / "_pytest").mkdir()
    (directory / "_pytest" / "__init__.py").write_text(NO_PYTEST)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(directory),
                                                        os.environ.get("PYTHONPATH")]))}


# -- generated tables -------------------------------------------------------------------------------
@pytest.mark.parametrize("table, page", [
    (dtype_table, "docs/guide/dtypes-and-ops.md"),
    (call_table, "docs/guide/collectives.md"),
    (variable_table, "docs/reference/environment.md"),
    (launcher_table, "docs/reference/launchers.md"),
])
def test_generated_tables_are_those_of_the_code(table, page):
    assert table() in (ROOT / page).read_text(), (
        f"{page}'s {table.__name__} is stale; paste there the output of "
        f"python -m cupycomm.tools.docs")


# -- the README: a front page -------------------------------------------------------------------
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_a_front_page_whose_links_work():
    """At most 8 KiB (the rest belongs in docs/), and every relative link names a file of
    the repository (the docs build checks the links between the pages themselves)."""
    text = README.read_text()
    assert len(text.encode()) <= 8 * 1024, "README.md is the front page: move details to docs/"
    targets = [m["target"] for m in LINK.finditer(text) if "://" not in m["target"]]
    assert len(targets) >= 10
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_self_check_passes_as_the_readme_runs_it(tmp_path):
    """Where the README's first command installed only the mpich extra (no pytest)."""
    command = ".venv/bin/python -m cupycomm.run -n 4 -m cupycomm"
    assert command in README.read_text()
    assert command in (ROOT / "docs" / "getting-started.md").read_text()
    job = run_job(4, "-m", "cupycomm", timeout=TIMEOUT, env=without_pytest(tmp_path))
    assert job.returncode == 0, job.output
    assert "self-check passed" in job.stdout


def test_no_shell_block_pasted_whole_installs_two_cupys():
    """A block of commands is pasted whole: one that installs the cuda12 and the cuda13 extra
    leaves two CuPys, and CuPy warns on every import on every rank. One block per choice."""
    for page in PAGES:
        for line, info, text in snippets(page):
            installs = [row for row in text.splitlines() if "pip install" in row]
            extras = {e for row in installs for e in re.findall(r"cuda1\d", row.split("#")[0])}
            assert len(extras) <= 1, (f"{page.relative_to(ROOT)}:{line}: one block installs "
                                      f"{sorted(extras)}: give each its own block")


def test_the_benchmarks_page_lists_every_committed_gpu_run():
    """Each run kept in benchmarks/results/gpu_* has its row (docs/guide/benchmarks.md's GPU
    runs), and the page says no more that none was made."""
    page = (ROOT / "docs" / "guide" / "benchmarks.md").read_text()
    runs = sorted(p.name for p in (ROOT / "benchmarks" / "results").glob("gpu_*"))
    missing = [run for run in runs if f"`{run}`" not in page]
    assert not missing, f"docs/guide/benchmarks.md does not list the GPU runs {missing}"
    if runs:
        assert "never run on a GPU" not in page and "not measured yet" not in page


# -- snippets -------------------------------------------------------------------------------------------
def test_the_pages_have_python_snippets():
    """The parser finds the snippets (else the test below would check nothing)."""
    assert len(list(python_snippets())) >= 20


def docstring_examples():
    """The ``Example (N ranks)::`` blocks of the package's docstrings, as (N, code)."""
    for path in sorted((ROOT / "cupycomm").rglob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            found = DOC_EXAMPLE.match(line)
            if found is None:
                continue
            indent, body = len(found["indent"]), []
            for text in lines[i + 2:]:
                if text.strip() and (len(text) - len(text.lstrip()) <= indent or '"""' in text):
                    break
                body.append(text)
            yield pytest.param(int(found["n"]), textwrap.dedent("\n".join(body)),
                               id=f"{path.relative_to(ROOT)}:{i + 1}")


@pytest.mark.parametrize("n, code", list(docstring_examples()))
def test_docstring_example_runs(n, code, tmp_path):
    """The examples of the API reference that say how many ranks they need run on that many
    (with ``numpy``, ``cupycomm`` and ``comm = cupycomm.init()`` given); their ``# Rank r:``
    comments are read by people, not checked."""
    (tmp_path / "example.py").write_text("import numpy\nimport cupycomm\n"
                                         "comm = cupycomm.init()\n" + code)
    job = run_mpiexec(n, "example.py", timeout=TIMEOUT, cwd=str(tmp_path))
    assert job.returncode == 0, code + job.output


@pytest.mark.parametrize("text", list(python_snippets()))
def test_snippet_runs(text, tmp_path):
    first = text.splitlines()[0]
    header = HEADER.match(first)
    assert header, (f"the snippet's first line is {first!r}, not '# [needs a GPU: ][mpiexec "
                    f"-n N ]python FILE.py ...' (see this file's docstring)")
    args = header["args"].split()
    script = next(a for a in args if a.endswith(".py"))
    (tmp_path / script).write_text(text)
    compile(text, script, "exec")
    if header["gpu"]:
        return   # needs a GPU: compiled only (CI has none); the snippet says so
    env = {}
    if args[:2] != ["-m", "pytest"]:
        (tmp_path / "no-test-extra").mkdir()
        env = without_pytest(tmp_path / "no-test-extra")
    if header["n"] is None:
        job = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True,
                             text=True, timeout=TIMEOUT, env=launch_environment(env))
        assert job.returncode == 0, job.stdout + job.stderr
        return
    options = header["options"].split()
    if "-disable-auto-cleanup" in options:
        options = [o for o in options if o != "-disable-auto-cleanup"] + no_auto_cleanup()
    job = run_mpiexec(int(header["n"]), *args, timeout=TIMEOUT, cwd=str(tmp_path),
                      mpiexec_args=options, env=env)
    assert not job.timed_out, job.output
    assert job.returncode == 0, job.output

"""The package's stated rules that a reader of the code can check: only ``_bootstrap`` touches
``MPI.COMM_WORLD``; every NCCL call is made in ``backends/`` (the benchmark's raw baselines
excepted: calling NCCL directly is their job; and the test stand-in, which is the NCCL it
stands for); ``run/`` imports nothing of ``faults/`` (which imports ``run.exit_records``);
no module reads the Communicator's private attributes (its parts are ``comm.parts``); the
backend contract lists what backends
implement, and Foreign wraps exactly the collectives of the table of calls; no module runs
source it generates."""
import ast
import inspect
import pathlib

import pytest

import cupycomm
from cupycomm import _collectives, backends
from cupycomm.backends.mpi import MPIBackend
from cupycomm.backends.nccl import NcclBackend

# They read the source and the classes, alike on every rank: under mpiexec -n 2, 3 and 4 each
# rank would repeat the same work on CI's 2 cores, for nothing the one-rank runs do not check.
pytestmark = pytest.mark.mpi(max_size=1)

PACKAGE = pathlib.Path(cupycomm.__file__).parent
NCCL_NAMES = {"nccl", "NcclCommunicator", "initAll", "groupStart", "groupEnd", "get_unique_id",
              "commSplit", "allReduce", "reduceScatter", "allGather"}
RAW_BASELINES = {pathlib.Path("bench/libraries.py"), pathlib.Path("bench/collectives.py")}
# The stand-in of CUDA and NCCL implements NCCL's names and meets its peers over the world, as
# NCCL's own bootstrap does outside cupycomm's communicators.
STANDIN = pathlib.Path("testing/standin.py")


def _modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _names_used(path):
    """(line, name) of every attribute read, imported name and imported module in ``path``."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.ImportFrom):
            if "backends" in (node.module or "").split("."):
                continue   # the package's own backends, by their names
            for part in (node.module or "").split("."):
                yield node.lineno, part
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for part in alias.name.split("."):
                    yield node.lineno, part


def _where(names, allowed):
    return [f"{path.relative_to(PACKAGE.parent)}:{line} uses {name}"
            for path in _modules() if not allowed(path.relative_to(PACKAGE))
            for line, name in _names_used(path) if name in names]


def test_only_bootstrap_touches_comm_world():
    assert _where({"COMM_WORLD"}, lambda p: p in {pathlib.Path("_bootstrap.py"), STANDIN}) == []


def test_every_nccl_call_is_in_backends():
    allowed = lambda p: p.parts[0] == "backends" or p in RAW_BASELINES | {STANDIN}
    assert _where(NCCL_NAMES, allowed) == []


def _imported_modules(path):
    """(line, the absolute name of each module that ``path``, a module of the package,
    imports, a ``from`` import's names included as modules it may be)."""
    package = ["cupycomm", *path.relative_to(PACKAGE).parent.parts]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def test_run_imports_nothing_of_faults():
    """The launcher's wing and the in-rank faults wing share only ``_private`` (and the
    helpers): ``faults`` imports ``run.exit_records``, so an arrow back would be a cycle."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted((PACKAGE / "run").rglob("*.py"))
             for line, module in _imported_modules(path)
             if module == "cupycomm.faults" or module.startswith("cupycomm.faults.")]
    assert found == []


def _private_attributes_of_the_communicator():
    tree = ast.parse((PACKAGE / "communicator.py").read_text())
    init = next(node for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    return {target.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name) and target.value.id == "self"
            and target.attr.startswith("_")}


def test_no_module_reads_the_communicators_private_attributes():
    """The Communicator is a façade: what cupycomm's modules use of it is ``comm.parts`` and
    its public attributes. A module's own ``self._x`` of the same name is its own."""
    private = _private_attributes_of_the_communicator()
    assert {"_checks", "_router", "_prepared"} <= private   # the rule reads the right names
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} reads .{node.attr}"
             for path in _modules() if path.name != "communicator.py" or path.parent != PACKAGE
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in private
             and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert found == []


def _methods(protocol):
    return {name for klass in protocol.__mro__ if klass.__module__ == backends.__name__
            for name, member in vars(klass).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("backend,protocol", [(MPIBackend, backends.HostBackend),
                                              (NcclBackend, backends.DeviceBackend)])
def test_backends_implement_their_whole_contract(backend, protocol):
    for name in _methods(protocol):
        ours = inspect.signature(getattr(backend, name)).parameters
        theirs = inspect.signature(getattr(protocol, name)).parameters
        assert list(ours) == list(theirs), f"{backend.__name__}.{name}"


def test_the_contracts_collectives_are_the_tables_backend_methods():
    ours = _methods(backends.Collectives) - {"empty", "begin_group", "end_group", "close"}
    assert ours == set(_collectives.BACKEND_METHODS)


def test_no_generated_source_runs():
    """No module runs source it generates (``exec``, ``eval``, ``compile``): every call path
    is code a reader and a traceback can see."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} calls {node.func.id}"
             for path in _modules() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in {"exec", "eval", "compile"}]
    assert found == []

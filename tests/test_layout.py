"""The package's stated rules that a reader of the code can check: its floors (a module
imports only from its own floor or those below, and no import, at any depth, makes a cycle);
only ``_bootstrap`` touches ``MPI.COMM_WORLD``; every NCCL call is made in ``backends/`` (the
benchmark's raw baselines excepted: calling NCCL directly is their job; and the test
stand-in, which is the NCCL it stands for); ``run/`` imports nothing of ``faults/`` (which
imports ``run.exit_records``); no module reads the Communicator's private attributes (its
parts are ``comm.parts``); the backend contract lists what backends implement, and Foreign
wraps exactly the collectives of the table of calls; no module runs source it generates;
every module's docstring is at most 15 lines."""
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


# The floors of the house, lowest first (docs/internals.md): each module is on the floor of
# the longest name here that is its own or a package holding it.
FLOORS = (
    ("tables", ("errors", "_dtypes", "_collectives", "_env", "backends.shapes",
                "run.launchers", "run.ranks")),
    ("process", ("_private", "_bootstrap", "run.exit_records")),
    ("below the Communicator", ("backends", "work", "faults", "survivors.lost",
                                "survivors.state", "survivors.policy", "survivors.numbering",
                                "survivors.grow", "survivors")),
    ("the Communicator", ("comm",)),
    ("its callers", ("_init", "devices", "survivors.committed", "survivors.resilient")),
    ("tools", ("", "__main__", "tools", "bench", "testing", "run")),
)


def _floor(module):
    """(floor number, name) of ``module``, a name under ``cupycomm.``."""
    inner = module[len("cupycomm."):] if module != "cupycomm" else ""
    found = [(len(name), number) for number, (_, names) in enumerate(FLOORS) for name in names
             if inner == name or inner.startswith(name + ".") or name == ""]
    number = max(found)[1]
    return number, FLOORS[number][0]


def _module_name(path):
    parts = ["cupycomm", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """{module: {module it imports: line}}: every import of the package's own modules, at
    module level, inside functions and under TYPE_CHECKING alike."""
    known = {_module_name(path): path for path in _modules()}
    graph = {}
    for name, path in known.items():
        edges = {}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                # a name that is a module is that module; another, its module's attribute
                found = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in known
                         else module for alias in node.names]
            else:
                continue
            for module in found:
                if module in known and module != name:
                    edges.setdefault(module, node.lineno)
        graph[name] = edges
    return graph


def test_no_import_runs_up_a_floor():
    found = [f"{name} ({_floor(name)[1]}):{line} imports {module} ({_floor(module)[1]})"
             for name, edges in _import_graph().items() for module, line in edges.items()
             if _floor(module)[0] > _floor(name)[0]]
    assert found == []


def test_no_import_cycle():
    graph = _import_graph()
    cycles = []
    for start in sorted(graph):   # a path back to ``start`` through modules after it
        stack, seen = [(start, [start])], {start}
        while stack:
            name, path = stack.pop()
            for module in graph[name]:
                if module == start:
                    cycles.append(" -> ".join(path + [start]))
                elif module > start and module not in seen:
                    seen.add(module)
                    stack.append((module, path + [module]))
    assert cycles == []


def test_a_subpackage_runs_nothing_but_its_own_modules_first():
    """Python runs a package's __init__ before any module of it: one that imported modules
    elsewhere would run them, unseen by the floors, before each of its modules."""
    found = [f"{name} imports {module}" for name, edges in _import_graph().items()
             if name.count(".") == 1 and PACKAGE.joinpath(*name.split(".")[1:]).is_dir()
             for module in edges if not module.startswith(name + ".")]
    assert found == []


def test_the_floors_see_what_the_code_imports():
    graph = _import_graph()
    assert _floor("cupycomm.backends.mpi")[0] < _floor("cupycomm.comm.route")[0]
    assert _floor("cupycomm.backends.shapes")[1] == "tables"
    assert _floor("cupycomm")[1] == _floor("cupycomm.tools.flight")[1] == "tools"
    assert "cupycomm.backends.mpi" in graph["cupycomm.comm.route"]            # module level
    assert "cupycomm.survivors.grow" in graph["cupycomm._init"]               # from . import
    assert "cupycomm.backends" in graph["cupycomm.faults.watchdog"]           # TYPE_CHECKING


def test_run_imports_nothing_of_faults():
    """The launcher's wing and the in-rank faults wing share only ``_private`` (and the
    helpers): ``faults`` imports ``run.exit_records``, so an arrow back would be a cycle."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
             for path in sorted((PACKAGE / "run").rglob("*.py"))
             for line, module in _imported_modules(path)
             if module == "cupycomm.faults" or module.startswith("cupycomm.faults.")]
    assert found == []


def _private_attributes_of_the_communicator():
    tree = ast.parse((PACKAGE / "comm" / "communicator.py").read_text())
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
    assert {"_checks", "_router", "_general"} <= private   # the rule reads the right names
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} reads .{node.attr}"
             for path in _modules() if path != PACKAGE / "comm" / "communicator.py"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in private
             and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert found == []


def test_only_the_communicators_folder_reaches_into_its_parts():
    """``comm.parts`` is the Communicator's own business: another module gets what it needs
    handed over (debug mode, survivors' grow). One exception: ``survivors/committed.py``
    waits for a communicator's device collectives (the NCCL backend's ``settle``), which
    has no public face yet."""
    allowed = {pathlib.Path("survivors/committed.py")}
    found = []
    for path in _modules():
        if path.relative_to(PACKAGE).parts[0] == "comm" or path.relative_to(PACKAGE) in allowed:
            continue
        tree = ast.parse(path.read_text())
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} reads .parts"
                  for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                  and node.attr == "parts" and id(node) not in called
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
    """The calls both backends run are the contract's; a call NCCL has no counterpart for
    (no ``nccl_call``: scan, exscan) is the host backend's alone, refused on the device by
    name before any backend is made."""
    ours = _methods(backends.Collectives) - {"empty", "begin_group", "end_group", "close"}
    host_only = {m for call in _collectives.CALLS if not call.nccl_call for m in call.methods}
    assert host_only and ours == set(_collectives.BACKEND_METHODS) - host_only
    assert all(callable(getattr(MPIBackend, name, None)) for name in host_only)
    assert not any(hasattr(NcclBackend, name) for name in host_only)


def test_every_call_of_the_table_is_a_public_method_with_a_general_path():
    """docs/internals.md, "Adding a collective": a row of the table of calls that users make
    with arrays is a Communicator method, and its general path's."""
    from cupycomm.comm.communicator import Communicator
    from cupycomm.comm.general import GeneralPath
    arrays = [call.name for call in _collectives.CALLS if call.methods]
    assert "scan" in arrays and "all_reduce" in arrays
    assert [name for name in arrays if not hasattr(Communicator, name)
            or not hasattr(GeneralPath, name)] == []


def test_no_generated_source_runs():
    """No module runs source it generates (``exec``, ``eval``, ``compile``): every call path
    is code a reader and a traceback can see."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} calls {node.func.id}"
             for path in _modules() for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in {"exec", "eval", "compile"}]
    assert found == []


MODULE_DOCSTRING_LINES = 15


def test_module_docstrings_are_short():
    """Every module's docstring is at most 15 lines, its quotes included (docs/internals.md,
    "Docstrings"): a summary and a pointer; the narrative lives in the docs."""
    long = []
    for path in _modules():
        tree = ast.parse(path.read_text(), str(path))
        first = tree.body[0] if tree.body else None
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            lines = first.end_lineno - first.lineno + 1
            if lines > MODULE_DOCSTRING_LINES:
                long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert long == [], "move the narrative to docs/internals.md"

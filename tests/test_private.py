"""A node shared with other users: what they plant in ``/dev/shm`` and the temporary directory
is neither followed nor used, a board that is not the job's own is refused on every rank,
the stale-file sweep touches only the user's own leftovers, and no module of the package
opens a predictable path in a shared directory (see docs/guide/security.md).

The names planted are those the code before the private directories used: the node board at
``/dev/shm/cupycomm-<pid of the node's first rank>-<n>`` and the plugin's stack files at
``<tmp>/cupycomm-stack-<pid>.txt``.
"""
import ast
import json
import os
import pathlib
import pwd
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np
import pytest
from mpi4py import MPI

import cupycomm
from cupycomm import _bootstrap
from cupycomm.errors import SharedFileRefused
from cupycomm import _private as private
from cupycomm.faults.board import Board
from cupycomm.faults.stacks import PeerStacks
from cupycomm.run.launchers import find
from cupycomm.testing import SIMULATES_NODES, no_auto_cleanup, run_mpiexec, simulated_nodes

PACKAGE = pathlib.Path(cupycomm.__file__).parent
PRECIOUS = b"a checkpoint of the job's user\n" * 45   # 1,395 bytes
FOREIGN = b"rows of another user\n" * 64
NOBODY = pwd.getpwnam("nobody").pw_uid
AS_ROOT = os.getuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="planting a file of another user (nobody) "
                                                    "needs root's chown")


def _old_board_name(pid, n):
    return os.path.join(private.shared_directory(), f"cupycomm-{pid}-{n}")


def _old_stack_name(pid, temporary=None):
    return os.path.join(temporary or tempfile.gettempdir(), f"cupycomm-stack-{pid}.txt")


def _plant_foreign(path):
    """A world-writable file of user nobody at ``path``."""
    with open(path, "wb") as f:
        f.write(FOREIGN)
    os.chown(path, NOBODY, NOBODY)
    os.chmod(path, 0o666)


def _unchanged_foreign(path):
    found = os.lstat(path)
    with open(path, "rb") as f:
        return (f.read() == FOREIGN and found.st_uid == NOBODY
                and stat.S_IMODE(found.st_mode) == 0o666)


def _nodes(comm):
    """(this rank's node's ranks, the size of the largest node), as every rank sees them."""
    nodes = comm.all_gather_object(_bootstrap.node_name())
    here = [r for r, node in enumerate(nodes) if node == nodes[comm.rank]]
    return here, max(nodes.count(node) for node in nodes)


# -- in the running job (any number of ranks, one node or several) ---------------------------------
def test_links_at_the_old_board_names_are_not_followed():
    """Every rank plants links at its own pid's old names (the node's first rank made the
    board there); a new communicator's board goes elsewhere, the files linked to are
    untouched and the links stay."""
    comm = cupycomm.init()
    own = tempfile.TemporaryDirectory()   # not tmp_path: the ranks would share its base
    target = pathlib.Path(own.name, "checkpoint")
    target.write_bytes(PRECIOUS)
    links = [_old_board_name(os.getpid(), n) for n in range(1000)]
    for link in links:
        os.symlink(target, link)
    try:
        comm.barrier()   # every rank has planted before the board is made
        sub = comm.split(0)
        assert sub.all_reduce(np.full(3, comm.rank + 1.0)).tolist() == [sum(
            range(1, comm.size + 1))] * 3
        sub.close()
        comm.barrier()
        assert target.read_bytes() == PRECIOUS
        assert all(os.path.islink(link) for link in links)
    finally:
        for link in links:
            os.unlink(link)
        own.cleanup()


@needs_root
def test_a_foreign_file_at_an_old_board_name_is_not_used():
    """World-writable files of user nobody at the old names: a new communicator's board is
    a file of the job's user (unlinked, 0600), the foreign files stay as they were."""
    comm = cupycomm.init()
    planted = [_old_board_name(os.getpid(), n) for n in range(1000)]
    for path in planted:
        _plant_foreign(path)
    try:
        comm.barrier()
        sub = comm.split(0)
        found = os.fstat(sub.parts.tracker.board._fd) if sub.size > 1 else None
        assert sub.all_reduce(np.ones(2)).tolist() == [comm.size] * 2
        sub.close()
        comm.barrier()
        if found is not None:
            assert (found.st_uid, stat.S_IMODE(found.st_mode), found.st_nlink) == (
                os.getuid(), 0o600, 0)
        assert all(_unchanged_foreign(path) for path in planted)
    finally:
        for path in planted:
            os.unlink(path)


def _spoil_on_creation(monkeypatch, spoil):
    """Make the node's first rank's next board file, then ``spoil(directory, fd)`` it before
    the node's other ranks open it."""
    create = private.create

    def spoiled(directory, name, size=0):
        fd = create(directory, name, size)
        spoil(directory, name, fd)
        return fd

    monkeypatch.setattr(private, "create", spoiled)


def _chmod(directory, name, fd):
    os.fchmod(fd, 0o644)


def _chown(directory, name, fd):
    os.fchown(fd, NOBODY, -1)


def _open_directory(directory, name, fd):
    os.chmod(directory, 0o755)


def _link(directory, name, fd):
    os.rename(os.path.join(directory, name), os.path.join(directory, "real"))
    os.symlink(os.path.join(directory, "real"), os.path.join(directory, name))


SPOILS = {
    "mode 0644": (_chmod, ["with mode 0644", "expected a regular file", "with mode 0600"]),
    "owned by nobody": (_chown, [f"owned by uid {NOBODY}", f"owned by uid {os.getuid()}"]),
    "directory 0755": (_open_directory, ["is a directory", "with mode 0755",
                                         "expected a directory", "with mode 0700"]),
    "a link": (_link, ["is a symbolic link"]),
}


@pytest.mark.parametrize("spoil", list(SPOILS))
def test_a_board_that_is_not_the_users_own_is_refused_on_every_rank(spoil, monkeypatch):
    """The node's first rank makes the board, then its mode, owner or kind is changed
    before the others open it: those that open it refuse it, and every rank of every node
    raises the same error (the agreement replaces the old barrier: nobody waits for a rank
    that gave up); the world goes on, nothing is left in /dev/shm."""
    if spoil == "owned by nobody" and not AS_ROOT:
        pytest.skip("chown to nobody needs root")
    comm = cupycomm.init()
    here, largest = _nodes(comm)
    before = set(os.listdir(private.shared_directory()))
    if comm.rank == here[0]:
        _spoil_on_creation(monkeypatch, SPOILS[spoil][0])
    if largest == 1:   # nobody opens a board someone else made
        sub = comm.split(0)
        sub.close()
        return
    with pytest.raises(SharedFileRefused) as refused:
        comm.split(0)
    message = str(refused.value)
    assert "the node board (shared memory) was refused" in message, message
    assert private.shared_directory() + "/cupycomm-" in message, message
    for part in SPOILS[spoil][1]:
        assert part in message, message
    monkeypatch.undo()
    comm.barrier()
    ours = {name for name in set(os.listdir(private.shared_directory())) - before
            if name.startswith(f"cupycomm-{os.getpid()}-")}
    assert ours == set()
    assert comm.all_reduce(np.ones(1)).tolist() == [comm.size]


def test_board_files_are_private_while_they_exist(monkeypatch):
    """The board's directory (0700) and file (0600, made with O_EXCL | O_NOFOLLOW) as the
    other ranks open them."""
    comm = cupycomm.init()
    seen = []
    create = private.create
    monkeypatch.setattr(private, "create", lambda d, n, size=0: (
        seen.append((os.lstat(d), d)), create(d, n, size))[1])
    node = _bootstrap.node_comm(comm.mpi_comm)
    try:
        made = Board(node, 4)
    finally:
        node.Free()
    if made.index == 0:
        (directory, path), = [(found, d) for found, d in seen]
        assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
        assert directory.st_uid == os.getuid()
        assert os.path.basename(path).startswith(f"cupycomm-{os.getpid()}-")
        assert not os.path.exists(path)   # removed once every rank had mapped it
    comm.barrier()   # (the node's first rank removes it after the agreement: then unlinked)
    found = os.fstat(made._fd)
    assert (found.st_uid, stat.S_IMODE(found.st_mode), found.st_nlink) == (os.getuid(), 0o600,
                                                                           0)


# -- jobs started with the names planted before they start -----------------------------------------
JOB_TEST = '''
import json, os
import numpy as np
import cupycomm
from cupycomm import _bootstrap

def test_the_job_works_on_boards_of_its_own():
    comm = cupycomm.init()
    sub = comm.split(comm.rank % 2)
    for c in (comm, sub):
        assert c.all_reduce(np.ones(2)).tolist() == [c.size] * 2
        if c.size > 1:
            found = os.fstat(c.parts.tracker.board._fd)
            assert (found.st_uid, found.st_mode & 0o777, found.st_nlink) == (os.getuid(), 0o600, 0)
    pids = comm.all_gather_object(os.getpid())
    if comm.rank == 0:
        with open(os.environ["JOB_PIDS"], "w") as f:
            json.dump(pids, f)
'''
JOBS = {"2 ranks": (2, []), "4 ranks": (4, []), "2 + 1 ranks on simulated nodes": (3, None)}
_PIDS_AHEAD = 2000   # pids planted past the last one used: the job's come within them


def _next_pids():
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    with open("/proc/sys/kernel/pid_max") as f:
        top = int(f.read())
    return [p if p < top else p - top + 300 for p in range(last + 1, last + 1 + _PIDS_AHEAD)]


@pytest.mark.mpi(max_size=1)
@pytest.mark.parametrize("job", list(JOBS))
def test_a_job_ignores_links_and_foreign_files_planted_before_it_starts(job, tmp_path):
    """For each of the next pids: links at the first old board names (the plugin's board,
    the world's, the split's) pointing at a file of the job's user, and world-writable
    files of user nobody at the others (as root); the old stack file's name, a link for an
    even pid and a foreign file for an odd one. The job (under the pytest plugin, whose
    hang guard makes stack files) passes, every linked file and foreign file is as it was
    for the job's ranks' pids, and those pids were among the planted."""
    n, extra = JOBS[job]
    if extra is None:
        if find().kind not in SIMULATES_NODES:
            pytest.skip("only MPICH's hydra can simulate nodes")
        extra = simulated_nodes(2, 1)
    (tmp_path / "test_job.py").write_text(JOB_TEST)
    # The job's temporary directory, as shared as /tmp (the old sweep of other sessions'
    # older cupycomm would remove in /tmp what is planted for pids not yet alive).
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    temporary.chmod(0o1777)
    targets = tmp_path / "targets"
    targets.mkdir()
    planted, foreign = {}, {}   # pid -> what was planted for it, its foreign files
    try:
        for pid in _next_pids():
            target = targets / str(pid)
            target.write_bytes(PRECIOUS)
            for number in range(6):
                name = _old_board_name(pid, number)
                if number % 2 and AS_ROOT:
                    _plant_foreign(name)
                    foreign.setdefault(pid, []).append(name)
                else:
                    os.symlink(target, name)
                planted.setdefault(pid, []).append(name)
            name = _old_stack_name(pid, str(temporary))
            if pid % 2 and AS_ROOT:
                _plant_foreign(name)
                foreign.setdefault(pid, []).append(name)
            else:
                os.symlink(target, name)
            planted[pid].append(name)
        pids_file = tmp_path / "pids.json"
        job_ = run_mpiexec(n, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_job.py",
                           timeout=120, cwd=str(tmp_path),
                           env={"JOB_PIDS": str(pids_file), "TMPDIR": str(temporary)},
                           mpiexec_args=no_auto_cleanup() + extra)
        assert job_.returncode == 0, job_.output
        assert "1 passed" in job_.output, job_.output
        pids = json.loads(pids_file.read_text())
        missed = [pid for pid in pids if not (targets / str(pid)).exists()]
        assert not missed, f"the job's pids {missed} were not among those planted"
        # Only the job's pids: another user's process (of an older cupycomm) may be given
        # one of the others meanwhile, and follow, use or remove what is planted for it.
        for pid in pids:
            assert (targets / str(pid)).read_bytes() == PRECIOUS, pid
            assert all(os.path.lexists(path) for path in planted[pid]), pid
            assert all(_unchanged_foreign(path) for path in foreign.get(pid, [])), pid
    finally:
        for path in (path for names in planted.values() for path in names):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# -- the sweep of leftovers -------------------------------------------------------------------------
@pytest.mark.mpi(max_size=1)
def test_the_sweep_removes_only_this_users_leftovers_of_processes_that_are_gone(
        tmp_path, monkeypatch):
    """A killed rank's private directory is removed by the next process that makes one in the
    same place; a live process's, another user's, a link with such a name (and what it
    points at) and anything else stay."""
    monkeypatch.setattr(private, "_swept", set())
    gone = _ended_pid()
    here = tmp_path / "shared"
    here.mkdir()

    def leftover(pid, owner=None):
        path = pathlib.Path(private.directory_of(str(here), pid, int.from_bytes(os.urandom(7),
                                                                                "big")))
        path.mkdir(mode=0o700)
        (path / "board").write_bytes(b"x")
        if owner is not None:
            os.chown(path / "board", owner, owner)
            os.chown(path, owner, owner)
        return path

    stale = leftover(gone)
    live = leftover(os.getppid())
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(PRECIOUS)
    link = pathlib.Path(private.directory_of(str(here), gone, 7))
    link.symlink_to(elsewhere)
    other = leftover(gone, NOBODY) if AS_ROOT else None
    (here / f"cupycomm-{gone}-notes").write_text("not ours")
    made, _ = private.make_directory(str(here))
    private.remove(made)
    assert not stale.exists()
    assert (live / "board").exists() and link.is_symlink()
    assert (elsewhere / "keep").read_bytes() == PRECIOUS
    assert (here / f"cupycomm-{gone}-notes").exists()
    if other is not None:
        assert (other / "board").exists()


def _ended_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.mpi(max_size=1)
def test_stack_files_are_private_and_found_through_the_board(tmp_path, monkeypatch):
    """A PeerStacks' file: mode 0600 in a 0700 directory of its own whose token is on its row
    of the board; a peer reads it from there; close removes the directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rows = np.zeros((2, 4), np.int64)
    boards = []
    for index in range(2):
        b = Board.__new__(Board)
        b.rows, b.mine, b.index = rows, rows[index], index
        lock = tempfile.TemporaryFile()
        b._fd = lock.fileno()
        weakref.finalize(b, lock.close)
        boards.append(b)
    mine = PeerStacks(boards[0], 0, 1, 2)
    try:
        directory = private.directory_of(str(tmp_path), os.getpid(), int(rows[0, 2]))
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(os.path.join(directory, "stacks.txt")).st_mode) == 0o600
        peer = PeerStacks.__new__(PeerStacks)
        peer._board, peer._asked, peer._written, peer._where = boards[1], 0, 1, 2
        asked = threading.Event()

        def watcher():   # the watcher thread's part
            while not asked.is_set():
                mine.answer("the failure")
                time.sleep(0.01)

        answering = threading.Thread(target=watcher)
        answering.start()
        try:
            text = peer.ask(0, os.getpid())
        finally:
            asked.set()
            answering.join()
        assert text.startswith("the failure") and "test_stack_files_are_private" in text, text
    finally:
        mine.close()
    assert not os.path.exists(directory)


@pytest.mark.mpi(max_size=1)
def test_a_whole_file_write_follows_no_link_planted_at_its_names(tmp_path):
    """The run records and the flight recorder's files (in a directory the user named, which
    may be shared): a link planted at the partial file's name or at the file's own name is
    replaced, never written through; the file is this user's, mode 0600."""
    precious = tmp_path / "checkpoint"
    precious.write_bytes(PRECIOUS)
    record = tmp_path / "rank-0.json"
    os.symlink(precious, f"{record}.{os.getpid()}")
    os.symlink(precious, record)
    private.replace_file(str(record), '{"state": "running"}')
    assert precious.read_bytes() == PRECIOUS
    assert not record.is_symlink() and record.read_text() == '{"state": "running"}'
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert os.readlink(f"{record}.{os.getpid()}") == str(precious)   # not the writer's: left


# -- files at paths the user named: one writer (_private.replacing) -------------------------------
def _shared(tmp_path):
    """A directory like /tmp: everyone's, sticky."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


def _plant_link(at, target):
    """A link at ``at`` to ``target``, another user's (nobody's) where this is root."""
    os.symlink(target, at)
    if AS_ROOT:
        os.lchown(at, NOBODY, NOBODY)


@pytest.mark.mpi(max_size=1)
def test_a_partial_name_planted_for_this_pid_does_not_stop_a_write(tmp_path):
    """The partial file's name was the path and the pid: another user who planted something
    there that the writer cannot remove (a directory, here; their file in a sticky directory)
    made every write of that process fail at its very end. Now the name is random."""
    shared = _shared(tmp_path)
    record = shared / "rank-0.json"
    for name in (f"{record}.{os.getpid()}", f"{record}.{os.getpid()}.tmp"):
        os.mkdir(name)
        if AS_ROOT:
            os.chown(name, NOBODY, NOBODY)
    private.replace_file(str(record), "{}")
    with private.replacing(str(record)) as out:
        out.write('{"state": "ended"}')
    assert record.read_text() == '{"state": "ended"}'
    assert sorted(p.name for p in shared.iterdir()) == sorted(
        ["rank-0.json", f"rank-0.json.{os.getpid()}", f"rank-0.json.{os.getpid()}.tmp"])


@pytest.mark.mpi(max_size=1)
def test_a_report_follows_no_link_planted_at_its_name(tmp_path, monkeypatch):
    """``python -m cupycomm --report PATH``: its check that PATH can be written opened PATH
    for appending and the report itself opened it for writing, both through a link there
    (another user's, in a shared directory such as /tmp), replacing its target."""
    from cupycomm import __main__
    from cupycomm.tools import fieldtest
    precious = tmp_path / "checkpoint"
    precious.write_bytes(PRECIOUS)
    report = _shared(tmp_path) / "cupycomm-report.json"
    _plant_link(report, precious)
    found = {"versions": {}, "topology": {"nodes": 1, "gpus_per_node": [0],
                                          "ranks_per_gpu": {}},
             "gpu": {"found": False, "why": "none"}, "exit_status": 3,
             "summary": {"pass": 1, "fail": 0, "not run": 0}}
    monkeypatch.setattr(fieldtest, "report", lambda comm, **kwargs: found)
    with cupycomm.init(MPI.COMM_SELF) as comm:
        assert __main__._writable(str(report), comm.mpi_comm) == ""
        assert fieldtest.run(comm, str(report)) == 3
    assert precious.read_bytes() == PRECIOUS
    assert not report.is_symlink() and json.loads(report.read_text()) == found


@pytest.mark.mpi(max_size=1)
@needs_root
def test_a_link_of_another_user_on_the_way_to_a_named_directory_is_refused(tmp_path, capsys):
    """CUPYCOMM_FLIGHT_RECORDER=DIR where another user planted DIR as a link to a directory
    of this user's (root's): the recorder made DIR (os.makedirs took the link) and wrote
    through it. Now no link of another user is followed, and the refusal is named."""
    from cupycomm.faults.flight import Recorder
    target = tmp_path / "root-owned"
    target.mkdir()
    planted = _shared(tmp_path) / "flight"
    _plant_link(planted, target)
    recorder = Recorder("world", 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUPYCOMM_FLIGHT_RECORDER", str(planted / "records"))
        recorder.close()   # writes its file a last time
    assert list(target.iterdir()) == []
    err = capsys.readouterr().err
    assert (f"cupycomm flight recorder: could not write {planted}/records: {planted} is a "
            f"symbolic link of uid {NOBODY}" in err), err
    _refused(planted, target, rf"{planted} is a symbolic link of uid {NOBODY}, not this "
                              rf"user's \(uid 0\) or root's: refused")


def _refused(directory, written, pattern):
    """A file at ``directory`` is refused, saying ``pattern``; nothing lands in ``written``."""
    with pytest.raises(SharedFileRefused, match=pattern):
        private.replace_file(str(directory / "rank-0.json"), "{}")
    assert list(written.iterdir()) == []


@pytest.mark.mpi(max_size=1)
@needs_root
@pytest.mark.parametrize("mode", [0o755, 0o1777])
def test_a_directory_of_another_user_is_refused(tmp_path, mode):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chmod(theirs, mode)
    os.chown(theirs, NOBODY, NOBODY)
    _refused(theirs, theirs, rf"{theirs} is a directory owned by uid {NOBODY} with mode "
                             rf"{mode:04o}, expected one of this user's \(uid 0\) or root's")


@pytest.mark.mpi(max_size=1)
def test_a_directory_everyone_may_change_is_refused_unless_sticky(tmp_path):
    """In a directory that every user may write, without the sticky bit (which /tmp has),
    anyone could rename a file written there away and put theirs in its place."""
    everyone = tmp_path / "everyone"
    everyone.mkdir()
    os.chmod(everyone, 0o777)
    _refused(everyone, everyone, rf"{everyone} is a directory owned by uid {os.getuid()} "
                                 rf"with mode 0777, expected one .* that no other user may "
                                 rf"change")
    os.chmod(everyone, 0o1777)
    private.replace_file(str(everyone / "rank-0.json"), "{}")
    assert (everyone / "rank-0.json").read_text() == "{}"


# -- the rule: no predictable path in a shared directory -------------------------------------------
SOURCES = {"gettempdir", "gettempdirb", "shared_directory", "temporary_directory"}
SHARED = ("/tmp", "/var/tmp", "/dev/shm", "TMPDIR")
# What makes a private place whatever its arguments (an unpredictable name, 0700 or O_EXCL).
SANITIZERS = {"mkdtemp", "mkstemp", "TemporaryDirectory", "TemporaryFile", "NamedTemporaryFile",
              "make_directory"}
# Calls that make, change or remove what a path names: functions (os.X, shutil.X, open) by
# their path arguments, methods (pathlib.Path's) by the path they are called on.
SINKS = {"open", "mkdir", "makedirs", "unlink", "remove", "rmdir", "rename", "replace",
         "symlink", "link", "chmod", "chown", "rmtree", "copy", "copyfile", "copy2", "move",
         "mkfifo", "mknod", "mktemp"}
METHOD_SINKS = {"open", "write_text", "write_bytes", "touch", "mkdir", "unlink", "rmdir",
                "symlink_to", "chmod", "rename"}
MODULES = {"os", "shutil", "tempfile", "pathlib"}
ALLOWED = {pathlib.Path("_private.py")}   # the private directories themselves


def _calls_name(call):
    func = call.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")


def _bound(targets):
    """The names that assignment targets bind (``a``, ``a, (b, *c)``; not ``a.b`` or ``a[b]``)."""
    for target in targets:
        if isinstance(target, ast.Name):
            yield target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            yield from _bound(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _bound([target.value])


class _Taint:
    """Which expressions of a module may hold a path in a shared directory: the sources
    above, names assigned from them (per function, loops and ``with`` included), results of
    calls that take them, functions that return them and the parameters they are passed
    to, through the module; a sanitizer's result is private whatever it was given."""

    def __init__(self, tree):
        defined = [f for f in ast.walk(tree)
                   if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        self.functions = {}        # name -> the functions (and methods) of that name
        for function in defined:
            self.functions.setdefault(function.name, []).append(function)
        self.names = {}            # scope -> tainted names
        self.returning = set()     # functions whose result is tainted
        self.scopes = [tree, *defined]
        changed = True
        while changed:
            changed = False
            for scope in self.scopes:
                changed |= self._scope(scope)

    def tainted(self, node, scope):
        if isinstance(node, ast.Call) and _calls_name(node) in SANITIZERS:
            return False
        if isinstance(node, ast.Call) and _calls_name(node) in SOURCES | self.returning:
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith(SHARED)
        if isinstance(node, ast.Name):
            return node.id in self.names.get(scope, set())
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        return any(self.tainted(child, scope) for child in ast.iter_child_nodes(node))

    def _own_nodes(self, scope):
        """The nodes of ``scope``, not those of functions defined inside it."""
        todo = list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                todo.extend(ast.iter_child_nodes(node))

    def _scope(self, scope):
        names = self.names.setdefault(scope, set())
        before = (len(names), len(self.returning),
                  sum(len(v) for v in self.names.values()))
        for node in self._own_nodes(scope):
            targets, value = [], None
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
            elif isinstance(node, (ast.For, ast.comprehension)):
                targets, value = [node.target], node.iter
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                targets, value = [node.optional_vars], node.context_expr
            if value is not None and self.tainted(value, scope):
                names.update(_bound(targets))
            if (isinstance(node, ast.Return) and node.value is not None
                    and self.tainted(node.value, scope) and hasattr(scope, "name")):
                self.returning.add(scope.name)
            for callee in (self.functions.get(_calls_name(node), [])
                           if isinstance(node, ast.Call) else []):
                params = [a.arg for a in callee.args.posonlyargs + callee.args.args]
                if params and params[0] in ("self", "cls") and isinstance(node.func,
                                                                           ast.Attribute):
                    params = params[1:]
                passed = list(zip(params, node.args)) + [(k.arg, k.value)
                                                         for k in node.keywords if k.arg]
                self.names.setdefault(callee, set()).update(
                    p for p, arg in passed if self.tainted(arg, scope))
        return before != (len(names), len(self.returning),
                          sum(len(v) for v in self.names.values()))

    def findings(self):
        """(line, call) of each sink given a tainted path (or called on one)."""
        found = []
        for scope in self.scopes:
            for node in self._own_nodes(scope):
                if not isinstance(node, ast.Call):
                    continue
                func, name = node.func, _calls_name(node)
                if isinstance(func, ast.Attribute) and not (
                        isinstance(func.value, ast.Name) and func.value.id in MODULES):
                    operands = [func.value] if name in METHOD_SINKS else []
                elif name in SINKS:
                    operands = [*node.args, *(k.value for k in node.keywords)]
                else:
                    continue
                if _calls_name(node) == "mktemp" or any(self.tainted(o, scope)
                                                        for o in operands):
                    found.append((node.lineno, ast.unparse(node)[:80]))
        return sorted(found)


def predictable_paths(source):
    return _Taint(ast.parse(source)).findings()


OLD_BOARD = '''
def shared_directory():
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

class Board:
    def __init__(self, node, fields):
        path = None
        if self.index == 0:
            path = os.path.join(shared_directory(), f"cupycomm-{os.getpid()}-{next(_names)}")
            with open(path, "wb") as f:
                f.truncate(nbytes)
        path = node.bcast(path, root=0)
        self._fd = os.open(path, os.O_RDWR)
'''
OLD_STACKS = '''
def _stack_file(pid):
    return os.path.join(tempfile.gettempdir(), f"cupycomm-stack-{pid}.txt")

def _remove_stale_stack_files():
    for path in glob.glob(_stack_file(0).replace("-0.txt", "-*.txt")):
        os.unlink(path)

def ask(pid):
    return _read(_stack_file(pid), 0)

def _read(path, start):
    with open(path) as f:
        return f.read()
'''
OTHERS = '''
from pathlib import Path
log = Path("/tmp") / "cupycomm.log"
log.write_text("x")
lock = Path(tempfile.gettempdir(), "cupycomm.lock").open("w")
name = tempfile.mktemp()
'''
SAFE = '''
def job_directory(where):
    if not where:
        where = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix=".cupycomm-run-", dir=where)

directory = job_directory(None)
with open(os.path.join(directory, "rank-0.json"), "w") as f:
    shutil.rmtree(directory)
'''


def test_the_rule_finds_the_predictable_paths_of_before():
    """The rule below is not a grep that cannot fail: the old board and stack files, and
    other shapes of the same mistake, are found; a private directory's files are not."""
    assert [line for line, _ in predictable_paths(OLD_BOARD)] == [10, 13]
    assert [line for line, _ in predictable_paths(OLD_STACKS)] == [7, 13]
    assert [line for line, _ in predictable_paths(OTHERS)] == [4, 5, 6]
    assert predictable_paths(SAFE) == []


@pytest.mark.mpi(max_size=1)   # reads the source: alike on every rank
def test_no_module_opens_a_predictable_path_in_a_shared_directory():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {call}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.relative_to(PACKAGE) not in ALLOWED
             for line, call in predictable_paths(path.read_text())]
    assert found == []

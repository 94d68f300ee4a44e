"""Private directories in the node's shared directories (``/dev/shm``, the temporary
directory), where the node's other users can neither plant nor read nor change anything.

Every file cupycomm makes outside a directory the user named is made here:
:func:`make_directory` (``<parent>/cupycomm-<pid>-<token>``, mode 0700, one ``mkdir``),
:func:`create`, :func:`open_checked` (another process's file, only if this user's, 0700 and
0600, no link), :func:`hold_directory`, :func:`remove` and :func:`sweep`. Files at paths the
user named are written by one writer, :func:`replacing` (:func:`replace_file` for text), and
read back by :func:`read_own`. Why each is safe: docs/internals.md, "_private.py".

Example::

    directory, token = make_directory(shared_directory())
    fd = create(directory, "board", size=4096)     # peers: open_checked(directory, "board")
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import tempfile
from typing import Any, Callable, Iterator, Optional, Set, Tuple

from .errors import SharedFileRefused

__all__ = ["alive", "shared_directory", "temporary_directory", "directory_of", "make_directory",
           "create", "open_checked", "hold_directory", "remove", "sweep", "open_directory",
           "replacing", "check_writable", "replace_file", "read_own"]

_NAME = re.compile(r"cupycomm-([0-9]+)-[0-9a-f]{16}\Z")
_swept: Set[str] = set()


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    try:   # a zombie has exited; its parent has just not reaped it yet
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:   # no /proc (not Linux): trust kill()
        return True


def shared_directory() -> str:
    """Where node-local shared memory goes: ``/dev/shm``, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else temporary_directory()


def temporary_directory() -> str:
    """The temporary directory (``TMPDIR`` and the like, as :mod:`tempfile` finds it)."""
    return tempfile.gettempdir()


def directory_of(parent: str, pid: int, token: int) -> str:
    """The path of process ``pid``'s private directory ``token`` in ``parent``."""
    return os.path.join(parent, f"cupycomm-{pid}-{token:016x}")


def make_directory(parent: str) -> Tuple[str, int]:
    """A new private directory of this process in ``parent``: (its path, its token). The
    leftovers of this user's processes that are gone are swept from ``parent`` first."""
    sweep(parent)
    while True:
        token = secrets.randbits(63)
        path = directory_of(parent, os.getpid(), token)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:   # as mkdtemp: 63 random bits taken; draw again
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchmod(fd, 0o700)   # whatever the umask took away
        finally:
            os.close(fd)
        return path, token


def create(directory: str, name: str, size: int = 0) -> int:
    """A new file ``name`` in the private ``directory``, mode 0600, ``size`` bytes of zeros;
    its descriptor, open for reading and writing."""
    fd = os.open(os.path.join(directory, name),
                 os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)   # whatever the umask took away
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_checked(directory: str, name: str, flags: int = os.O_RDWR) -> int:
    """The descriptor of file ``name`` in ``directory``, which another process of this user
    made with :func:`make_directory` and :func:`create`; SharedFileRefused, naming what was
    found, unless the directory is a directory and the file a regular file, both owned by
    this user, with modes 0700 and 0600 (checked on the opened descriptors: nothing can be
    swapped in between), and neither is a link."""
    dfd = hold_directory(directory)
    try:
        return _open_and_check(os.path.join(directory, name), flags, stat.S_ISREG,
                               "a regular file", 0o600, dfd)
    finally:
        os.close(dfd)


def hold_directory(directory: str) -> int:
    """The descriptor of ``directory``, a private directory of this user's (mode 0700, as
    :func:`make_directory` and ``tempfile.mkdtemp`` make them), opened following no link
    and checked on the descriptor (SharedFileRefused otherwise): what is read or removed
    through it is in that directory, whatever its name comes to name later."""
    return _open_and_check(directory, os.O_RDONLY | os.O_DIRECTORY, stat.S_ISDIR,
                           "a directory", 0o700)


def _open_and_check(path: str, flags: int, kind: Callable[[int], bool], kind_name: str,
                    mode: int, dir_fd: Optional[int] = None) -> int:
    """``path`` opened following no link (in ``dir_fd`` if given), and :func:`_check`-ed."""
    fd = _open_no_link(path, flags, kind_name, dir_fd)
    try:
        _check(fd, path, kind, kind_name, mode)
    except SharedFileRefused:
        os.close(fd)
        raise
    return fd


def _open_no_link(path: str, flags: int, what: str, dir_fd: Optional[int] = None) -> int:
    """``os.open`` with O_NOFOLLOW (``path``'s last part, in ``dir_fd`` if given); a link
    there is refused by name."""
    try:
        return os.open(os.path.basename(path) if dir_fd is not None else path,
                       flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        if os.path.islink(path):
            raise SharedFileRefused(f"{path} is a symbolic link, expected {what} of this "
                                    f"user's (uid {os.getuid()}): refused") from None
        raise


def _check(fd: int, path: str, kind: Callable[[int], bool], kind_name: str,
           mode: int) -> None:
    found = os.fstat(fd)
    uid = os.getuid()
    if kind(found.st_mode) and found.st_uid == uid and stat.S_IMODE(found.st_mode) == mode:
        return
    what = "a directory" if stat.S_ISDIR(found.st_mode) else (
        "a regular file" if stat.S_ISREG(found.st_mode) else "neither a file nor a directory")
    raise SharedFileRefused(
        f"{path} is {what} owned by uid {found.st_uid} with mode "
        f"{stat.S_IMODE(found.st_mode):04o}, expected {kind_name} owned by uid {uid} (this "
        f"process's user) with mode {mode:04o}: refused (another user of the node may have "
        f"planted or changed it)")


def remove(directory: str, held: Optional[int] = None) -> None:
    """Remove the private ``directory`` and the files in it (a link is removed, never
    followed); what is already gone is no error. ``held``: its descriptor
    (:func:`hold_directory`, left open): the files go from there, and the name only while it
    still names that directory."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW) if (
            held is None) else held
    except OSError:
        return
    try:
        for name in os.listdir(dfd):
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:   # a directory, or removed meanwhile: rmdir below says so
                pass
        if held is not None and not _names(directory, held):
            return   # renamed away (another user's directory in its place is theirs)
    finally:
        if held is None:
            os.close(dfd)
    try:
        os.rmdir(directory)
    except OSError:
        pass


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` names the directory open as ``fd``."""
    try:
        return os.path.samestat(os.lstat(path), os.fstat(fd))
    except OSError:
        return False


def sweep(parent: str) -> None:
    """Remove from ``parent`` the private directories of this user's processes that are gone,
    once per process: entries of other users, links and anything else are left alone."""
    if parent in _swept:
        return
    _swept.add(parent)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        match = _NAME.match(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        path = os.path.join(parent, name)
        try:
            found = os.lstat(path)
        except OSError:
            continue
        if (stat.S_ISDIR(found.st_mode) and found.st_uid == uid
                and not alive(int(match.group(1)))):
            remove(path)


def open_directory(path: str, make: bool = False) -> int:
    """The descriptor of directory ``path``, which the user named, to write files in: reached
    following no link but this user's and root's (another user's link on the way is refused),
    its missing parts made if ``make`` (mode 0777 less the umask), and refused unless it is
    this user's or root's and no other user may change its entries (not writable by others,
    or sticky, as /tmp is; its group is trusted). SharedFileRefused names what was found."""
    uid = os.getuid()
    fd = os.open("/" if os.path.isabs(path) else ".", os.O_RDONLY | os.O_DIRECTORY)
    where = "/" if os.path.isabs(path) else ""
    try:
        for part in [p for p in path.split("/") if p not in ("", ".")]:
            where = os.path.join(where, part)
            try:
                step = _step(fd, part, where, make, uid)
            except OSError as error:   # named by the whole path, not its last part
                error.filename = where
                raise
            os.close(fd)
            fd = step
        found = os.fstat(fd)
        mode = stat.S_IMODE(found.st_mode)
        if found.st_uid not in (uid, 0) or mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            raise SharedFileRefused(
                f"{path} is a directory owned by uid {found.st_uid} with mode {mode:04o}, "
                f"expected one of this user's (uid {uid}) or root's that no other user may "
                f"change (not writable by others, or sticky as /tmp is): refused")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(fd: int, part: str, where: str, make: bool, uid: int) -> int:
    """The descriptor of directory ``part`` in directory ``fd`` (``where``: its path): not
    through another user's link; made if missing and ``make``."""
    flags = os.O_RDONLY | os.O_DIRECTORY
    try:
        return os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError:
        if not make:
            raise
        try:
            os.mkdir(part, 0o777, dir_fd=fd)
        except FileExistsError:   # made meanwhile (a peer rank): checked as any other below
            pass
        return _step(fd, part, where, False, uid)
    except OSError:   # a link (ELOOP), or not a directory
        found = os.stat(part, dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISLNK(found.st_mode):
            raise
        if found.st_uid not in (uid, 0):
            raise SharedFileRefused(f"{where} is a symbolic link of uid {found.st_uid}, not "
                                    f"this user's (uid {uid}) or root's: refused (another "
                                    f"user may have planted it)") from None
        return os.open(part, flags, dir_fd=fd)   # this user's own link (or root's): taken


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", *, permissions: int = 0o600, make: bool = False,
              **kwargs: Any) -> Iterator[Any]:
    """The one writer of a whole file at a path the user named (reports, tables, plots, the
    flight recorder's files, a run's records): a file object on a new file (``permissions``
    less the umask) under a random name beside ``path``, renamed to ``path`` once written,
    so a reader never sees half of it and a run that fails midway leaves ``path`` as it was.
    Nothing planted can divert it: the directory is checked and held (:func:`open_directory`;
    ``make``: made if missing), the new file is created, never opened (``O_EXCL |
    O_NOFOLLOW``), and the rename replaces a link at ``path``, never follows it.

    Example::

        with replacing("rows.csv", newline="", permissions=0o666) as out:
            out.write("size,time\\n")
    """
    directory, name = os.path.split(path)
    dfd = open_directory(directory or ".", make)
    try:
        fd, partial = _new_partial(dfd, name, permissions)
        try:
            with os.fdopen(fd, mode, **kwargs) as out:
                yield out
            os.replace(partial, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(partial, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)


def _new_partial(dfd: int, name: str, permissions: int) -> Tuple[int, str]:
    """A new file beside ``name`` in the directory open as ``dfd``: (its descriptor, open for
    writing, and its random name)."""
    while True:
        partial = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                           permissions, dir_fd=dfd), partial
        except FileExistsError:   # 64 random bits taken: draw again
            continue


def check_writable(path: str) -> None:
    """Raise what :func:`replacing` would raise before writing ``path`` (its directory
    missing, refused or not writable), leaving ``path`` as it is: for a command that writes
    its file at the end of a long run."""
    directory, name = os.path.split(path)
    dfd = open_directory(directory or ".")
    try:
        fd, partial = _new_partial(dfd, name, 0o600)
        os.close(fd)
        os.unlink(partial, dir_fd=dfd)
    finally:
        os.close(dfd)


def replace_file(path: str, text: str, make: bool = False) -> None:
    """Write ``text`` as the whole of ``path``, mode 0600 (:func:`replacing`)."""
    with replacing(path, make=make) as out:
        out.write(text)


def read_own(directory_fd: int, name: str, where: str) -> str:
    """The text of file ``name`` in the directory open as ``directory_fd`` (``where``: its
    path, for messages), read only if it is a regular file of this user's that no other user
    may write, and not a link; SharedFileRefused otherwise (checked on the opened descriptor;
    a FIFO is opened without waiting for a writer)."""
    path = os.path.join(where, name)
    fd = _open_no_link(path, os.O_RDONLY | os.O_NONBLOCK, "a regular file", directory_fd)
    with os.fdopen(fd) as f:
        found = os.fstat(fd)
        uid = os.getuid()
        if (not stat.S_ISREG(found.st_mode) or found.st_uid != uid
                or found.st_mode & stat.S_IWOTH):
            what = "a directory" if stat.S_ISDIR(found.st_mode) else (
                "a regular file" if stat.S_ISREG(found.st_mode)
                else "neither a file nor a directory")
            raise SharedFileRefused(
                f"{path} is {what} owned by uid {found.st_uid} with mode "
                f"{stat.S_IMODE(found.st_mode):04o}, expected one of this user's (uid {uid}) "
                f"that no other user may write: refused (another user may have planted it)")
        return f.read()

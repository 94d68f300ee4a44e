"""Private directories in the node's shared directories (``/dev/shm``, the temporary
directory), where the node's other users can neither plant nor read nor change anything.

Every file cupycomm makes outside a directory the user named is made here:

- :func:`make_directory`: ``<parent>/cupycomm-<pid>-<token>``, mode 0700, by one ``mkdir``
  (which takes no existing entry and follows no link); ``token`` is 63 random bits, so no
  one can guess the name in advance, and it fits in a board's int64 field;
- :func:`create`: a new file in such a directory (``O_CREAT | O_EXCL | O_NOFOLLOW``, 0600);
- :func:`open_checked`: a file that another process of the job made there, opened only if
  the directory and the file are this user's, with modes 0700 and 0600, and no link
  (:class:`~cupycomm.errors.SharedFileRefused` otherwise);
- :func:`remove`: the directory and its files, following no link;
- :func:`sweep`: the directories of this user's processes that are gone (a killed rank never
  removes its own), once per process and parent; other users' entries are never touched;
  :func:`alive` says which processes are gone.

:func:`replace_file` writes a whole file in a directory the user named (``os.replace`` of a
new 0600 file), so a reader never sees half of it and no link planted at its name is
followed.

Example::

    directory, token = make_directory(shared_directory())
    fd = create(directory, "board", size=4096)     # peers: open_checked(directory, "board")
    ...
    remove(directory)
"""
from __future__ import annotations

import os
import re
import secrets
import stat
import tempfile
from typing import Callable, Optional, Set, Tuple

from .errors import SharedFileRefused

__all__ = ["alive", "shared_directory", "temporary_directory", "directory_of", "make_directory",
           "create", "open_checked", "remove", "sweep", "replace_file"]

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
    path = os.path.join(directory, name)
    dfd = _open_no_link(directory, os.O_RDONLY | os.O_DIRECTORY, "directory")
    try:
        _check(dfd, directory, stat.S_ISDIR, "a directory", 0o700)
        fd = _open_no_link(path, flags, "regular file", dfd)
    finally:
        os.close(dfd)
    try:
        _check(fd, path, stat.S_ISREG, "a regular file", 0o600)
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
            raise SharedFileRefused(f"{path} is a symbolic link, expected a {what} of this "
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


def remove(directory: str) -> None:
    """Remove the private ``directory`` and the files in it (a link is removed, never
    followed); what is already gone is no error."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        for name in os.listdir(dfd):
            try:
                os.unlink(name, dir_fd=dfd)
            except OSError:   # a directory, or removed meanwhile: rmdir below says so
                pass
    finally:
        os.close(dfd)
    try:
        os.rmdir(directory)
    except OSError:
        pass


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


def replace_file(path: str, text: str) -> None:
    """Write ``text`` as the whole of ``path`` (a directory the user named): a new file of
    mode 0600 beside it (``O_EXCL | O_NOFOLLOW``), then renamed over it."""
    partial = f"{path}.{os.getpid()}"
    try:
        os.unlink(partial)   # a partial this pid left before (removed, not followed)
    except FileNotFoundError:
        pass
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(partial, path)

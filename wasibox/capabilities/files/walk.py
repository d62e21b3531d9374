"""The one confinement walker: how the host reaches a directory on a guest's behalf.

Every directory the host opens by path inside a mount, a staging tree, a microVM's copy of a
mount or an agent's workspace is reached from a descriptor the host trusts, one component at
a time, each opened relative to its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY``. A
symbolic link is never followed, wherever it points, and a component that is not a directory
stops the walk, so nothing planted or raced on the way can lead out of the root. There is no
check-then-open window: the check *is* the open.

``FileSession`` (a guest's file operations), publishing and reclaiming (moving staged files
into a mount), the microVM's copy-in and copy-out, and the MCP server's workspace file tools
all walk with :func:`walk`, and open the last component themselves with ``FILE_FLAGS`` or
``DIR_FLAGS``, which never follow a link either. The symbolic links a guest sees followed are
``FileSession``'s doing: it reads each link and walks again, from the guest's namespace.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

__all__ = ["DIR_FLAGS", "FILE_FLAGS", "Blocked", "blocked", "walk"]

#: How every directory on a walk is opened.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: How a file at the end of a walk is opened to read it: never through a link, and
#: non-blocking, so a planted FIFO cannot hang the host.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Blocked(Exception):
    """A walk stopped at ``part``: it is missing, hidden, a symbolic link, not a directory,
    or could not be opened. ``error`` is the OSError the open raised; ``is_link`` says
    whether ``part`` is a symbolic link, None when the refusal was ``ENOTDIR``/``ELOOP`` but
    ``part`` could not be examined."""

    def __init__(self, part: str, error: OSError, is_link: bool | None = False) -> None:
        super().__init__(part)
        self.part = part
        self.error = error
        self.is_link = is_link


def blocked(dir_fd: int, part: str, error: OSError) -> Blocked:
    """The Blocked for opening ``part`` in ``dir_fd`` having failed with ``error``: a refusal
    to follow (``ENOTDIR``, ``ELOOP``) says whether ``part`` is a symbolic link."""
    if error.errno not in (errno.ENOTDIR, errno.ELOOP):
        return Blocked(part, error)
    try:
        st = os.stat(part, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return Blocked(part, error, None)
    return Blocked(part, error, stat.S_ISLNK(st.st_mode))


def walk(root_fd: int, parts: Sequence[str], *, create: bool = False,
         hidden: str | None = None) -> int:
    """A new descriptor of the directory ``parts`` below ``root_fd``; the caller closes it.

    With ``create``, a missing directory on the way is made (mode 0o755) and then opened
    like any other; an OSError making it (a full disk) propagates as it is. A component named
    ``hidden`` counts as missing (and is never made). A component that is not one name
    (empty, ``.``, ``..``, or holding ``/`` or NUL) is refused with ``EINVAL``, whatever the
    caller checked before: the walk itself never leaves the root. Raises Blocked at the
    first component that cannot be walked.
    """
    fd = os.dup(root_fd)
    try:
        for part in parts:
            if part in ("", ".", "..") or "/" in part or "\x00" in part:
                raise Blocked(part, OSError(errno.EINVAL, os.strerror(errno.EINVAL)))
            if part == hidden:
                raise Blocked(part, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT)))
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError as exc:
                if not create:
                    raise Blocked(part, exc) from None
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass  # made by someone else meanwhile: open what is there now
                try:
                    child = os.open(part, DIR_FLAGS, dir_fd=fd)
                except OSError as error:
                    raise blocked(fd, part, error) from None
            except OSError as exc:
                raise blocked(fd, part, exc) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd

"""The guest side of the ``files`` capability: ``open``, ``os`` and pathlib over host mounts.

The guest has no WASI preopens, so CPython's own file functions can reach nothing. At
pre-init, ``install()`` replaces ``builtins.open``, ``io.open``, ``io.open_code``,
``io.FileIO`` (and the same names in ``_io``), ``tokenize.open``'s reader, and the ``os``
functions that Python code (and pathlib, shutil, os.walk, glob, tempfile, csv over files)
builds on, in both ``os`` and ``posix`` (which importlib and linecache call directly), with
versions that ask the host, through ``guest/wit/files.wit``. So the import system
(modules and packages on ``sys.path``, ``importlib.resources``, ``runpy``), tracebacks and
every Python-level reader see one view of the mounts, under one confinement. The host decides
everything: which paths exist, what may change, quotas. Replacing these functions back (or
calling the originals some other way) gains the guest nothing: the originals see no files.

Descriptors the host hands out are plain ints (from 256 up); functions given any other
descriptor fall through to the original (stdio). ``dir_fd`` arguments are not supported,
and ``os.supports_dir_fd`` says so, so library code does not try them. Arguments are checked
as CPython's C functions check them (paths by ``_convert``, as its ``path_t`` converter),
with the same exceptions, before anything reaches the host interface, whose bindings would
abort the guest on a value of the wrong type or size.

This module never imports the host package.
"""

import _io
import builtins
import errno
import io
import math
import operator
import os
import posix
import posixpath
import stat as _stat
import sys
import tokenize
import types
import warnings
import weakref

from componentize_py_types import Err
from wit_world.imports import files as _files

__all__ = ["install", "finish"]

# The bits of the `open` flags parameter (guest/wit/files.wit).
_F_READ, _F_WRITE, _F_CREATE, _F_EXCL, _F_TRUNC, _F_APPEND, _F_DIRECTORY, _F_NOFOLLOW, _F_NOTDIR = (
    1 << i for i in range(9))
_BUFFER_SIZE = 1 << 16  # bigger than io's default: each refill is a host call
_READ_ALL_CHUNK = 1 << 20
# The most one read or write moves, as on Linux (a larger count is not an error: the call
# moves less); it keeps every count inside the interface's u32.
_MAX_IO = 0x7FFFF000
_S64 = 1 << 63  # times travel as s64 nanoseconds

_ERRNO = {code: getattr(errno, "E" + code.name) for code in _files.ErrorCode}
# Index = the `kind` field of a stat string (guest/wit/files.wit).
_KIND_BITS = (_stat.S_IFREG, _stat.S_IFDIR, _stat.S_IFLNK, 0)
_DIRECTORY = 1
_TAGS = {"f": _stat.S_IFREG, "d": _stat.S_IFDIR, "l": _stat.S_IFLNK, "o": 0}

_real = {}  # name: the os function install() replaced, for what is not the host's
_real_open = io.open
_RealFileIO = io.FileIO

_fds = set()  # descriptors the host gave this run
_nonblocking = set()  # of _fds: O_NONBLOCK asked for, which files ignore as on Linux
_opened = weakref.WeakSet()  # file objects made by open(), closed at the end of the run
_cwd = "/"


def _error(code, filename=None, filename2=None):
    number = _ERRNO[code]
    if filename2 is not None:
        return OSError(number, os.strerror(number), filename, None, filename2)
    if filename is not None:
        return OSError(number, os.strerror(number), filename)
    return OSError(number, os.strerror(number))


def _call(function, *args, filename=None, filename2=None):
    try:
        return function(*args)
    except Err as exc:
        code = exc.value
        # The binding's frame, raising it, holds it: a cycle through the traceback that kept
        # every caller's frame (and their locals) alive until a collection, where CPython's
        # C functions free them at once. with_traceback, as the Err is a frozen dataclass.
        exc.with_traceback(None)
    # Raised outside the except block: the binding's Err (a frozen dataclass) must not become
    # the OSError's __context__, where unittest, cleaning tracebacks, would try to assign
    # its __traceback__ and fail.
    raise _error(code, filename, filename2)


_KINDS = {(False, False): "string, bytes or os.PathLike",
          (True, False): "string, bytes, os.PathLike or integer",
          (False, True): "string, bytes, os.PathLike or None",
          (True, True): "string, bytes, os.PathLike, integer or None"}


def _convert(function, value, argument="path", allow_fd=False, nullable=False):
    """An os function's path argument, checked as CPython's ``path_t`` converter checks it:
    a str or bytes (what ``__fspath__`` returned, for a path-like), an int descriptor where
    ``allow_fd``, None where ``nullable``. Raises TypeError for any other type (bytearray
    and memoryview too) and ValueError for an embedded NUL, with CPython's messages; the
    arguments of the host interface are never of the wrong type."""
    if value is None and nullable:
        return None
    if allow_fd and not isinstance(value, (str, bytes)) and \
            hasattr(type(value), "__index__"):
        return operator.index(value)
    if not isinstance(value, (str, bytes)):
        fspath = getattr(type(value), "__fspath__", None)
        if fspath is None:
            raise TypeError(f"{function}: {argument} should be {_KINDS[allow_fd, nullable]}, "
                            f"not {type(value).__name__}")
        result = fspath(value)
        if not isinstance(result, (str, bytes)):
            raise TypeError(f"expected {type(value).__name__}.__fspath__() to return str or "
                            f"bytes, not {type(result).__name__}")
        value = result
    if ("\x00" if isinstance(value, str) else b"\x00") in value:
        raise ValueError(f"{function}: embedded null character in {argument}")
    return value


def _path(function, path, argument="path", allow_fd=False):
    """The absolute guest path of a str, bytes or path-like argument, or the descriptor an
    integer is where ``allow_fd`` (``_convert``'s checks). Raises FileNotFoundError for a
    name no mount can hold."""
    name = _convert(function, path, argument, allow_fd)
    if isinstance(name, int):
        return name
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    if not name:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
    if not name.startswith("/"):
        name = _cwd.rstrip("/") + "/" + name
    return name


def _ours(fd):
    """Whether ``fd`` is a descriptor the host gave this run (not one equal to it, as
    256.0 is: that goes to the original function, which raises TypeError)."""
    return isinstance(fd, int) and fd in _fds


def _int64(value):
    """An offset or length as CPython's ``off_t`` converter takes it: an integer (TypeError
    otherwise) that fits in 64 bits (OverflowError otherwise)."""
    value = operator.index(value)
    if not -_S64 <= value < _S64:
        raise OverflowError("Python int too large to convert to C long")
    return value


def _count(size):
    """A byte count to read: an integer, not negative, at most what one call moves."""
    size = operator.index(size)
    if size < 0:
        raise ValueError("negative size")
    return min(size, _MAX_IO)


def _no_dir_fd(dir_fd, name):
    if dir_fd is not None:
        raise NotImplementedError(f"{name}: dir_fd unavailable on this platform")


def _fields(text):
    """The nine integers of a stat string: kind mode size ino dev nlink atime mtime ctime."""
    return list(map(int, text.split(" ")))


def _stat_result(fields):
    kind, mode, size, ino, dev, nlink, atime, mtime, ctime = fields
    return os.stat_result((_KIND_BITS[kind] | mode, ino, dev, nlink, 0, 0, size,
                           atime // 10**9, mtime // 10**9, ctime // 10**9,
                           atime / 1e9, mtime / 1e9, ctime / 1e9, atime, mtime, ctime))


# -- os: descriptors --------------------------------------------------------------------------

def _os_open(path, flags, mode=0o777, *, dir_fd=None, _extra=0):
    _no_dir_fd(dir_fd, "open")
    bits = _extra
    if flags & os.O_RDONLY or not flags & os.O_WRONLY:
        bits |= _F_READ
    if flags & os.O_WRONLY:
        bits |= _F_WRITE
    for flag, bit in ((os.O_CREAT, _F_CREATE), (os.O_EXCL, _F_EXCL), (os.O_TRUNC, _F_TRUNC),
                      (os.O_APPEND, _F_APPEND), (os.O_DIRECTORY, _F_DIRECTORY),
                      (os.O_NOFOLLOW, _F_NOFOLLOW)):
        if flags & flag:
            bits |= bit
    fd = _call(_files.open, _path("open", path), bits, mode & 0o7777, filename=path)
    _fds.add(fd)
    return fd


def _read(fd, size):
    if not _ours(fd):
        return _real["read"](fd, size)
    return _call(_files.read, fd, _count(size)).encode("latin-1")


def _readinto(fd, buffer):
    if not _ours(fd):
        return _real["readinto"](fd, buffer)
    view = memoryview(buffer)  # TypeError for what is not a buffer, as CPython's
    if view.readonly:
        raise TypeError("readinto() argument 2 must be read-write bytes-like object, not "
                        f"{type(buffer).__name__}")
    view = view.cast("B")
    data = _read(fd, len(view))
    view[:len(data)] = data
    return len(data)


def _write(fd, data):
    if not _ours(fd):
        return _real["write"](fd, data)
    return _call(_files.write, fd, bytes(data).decode("latin-1"))


def _pread(fd, size, offset):
    if not _ours(fd):
        return _real["pread"](fd, size, offset)
    size, offset = _count(size), _int64(offset)
    if offset < 0:
        raise _error(_files.ErrorCode.INVAL)
    return _call(_files.pread, fd, size, offset).encode("latin-1")


def _pwrite(fd, data, offset):
    if not _ours(fd):
        return _real["pwrite"](fd, data, offset)
    offset = _int64(offset)
    if offset < 0:
        raise _error(_files.ErrorCode.INVAL)
    return _call(_files.pwrite, fd, bytes(data).decode("latin-1"), offset)


def _dup(fd):
    if not _ours(fd):
        return _real["dup"](fd)
    new = _call(_files.dup, fd)
    _fds.add(new)
    return new


def _close(fd):
    if not _ours(fd):
        return _real["close"](fd)
    _fds.discard(fd)
    _nonblocking.discard(fd)
    _call(_files.close, fd)


def _lseek(fd, position, how):
    if not _ours(fd):
        return _real["lseek"](fd, position, how)
    position, how = _int64(position), operator.index(how)
    if how not in (os.SEEK_SET, os.SEEK_CUR, os.SEEK_END):
        raise _error(_files.ErrorCode.INVAL)
    return _call(_files.seek, fd, position, how)


def _fstat(fd):
    if not _ours(fd):
        return _real["fstat"](fd)
    return _stat_result(_fields(_call(_files.fstat, fd)))


def _ftruncate(fd, length):
    if not _ours(fd):
        return _real["ftruncate"](fd, length)
    length = _int64(length)
    if length < 0:
        raise _error(_files.ErrorCode.INVAL)
    _call(_files.truncate, fd, length)


def _fsync(fd):
    fd = fd if isinstance(fd, int) else fd.fileno()
    if not _ours(fd):
        return _real["fsync"](fd)
    _call(_files.fstat, fd)  # the host publishes whole files; there is nothing to sync


def _fdatasync(fd):
    return _fsync(fd)


def _isatty(fd):
    if _ours(fd):
        return False
    return _real["isatty"](fd)


def _get_blocking(fd):
    if not _ours(fd):
        return _real["get_blocking"](fd)
    return fd not in _nonblocking


def _set_blocking(fd, blocking):
    if not _ours(fd):
        return _real["set_blocking"](fd, blocking)
    (_nonblocking.discard if blocking else _nonblocking.add)(fd)


# -- os: paths --------------------------------------------------------------------------------

def _os_stat(path, *, dir_fd=None, follow_symlinks=True, _function="stat"):
    name = _path(_function, path, allow_fd=_function == "stat")
    if isinstance(name, int):
        return _fstat(name)
    _no_dir_fd(dir_fd, _function)
    # The host follows a final link (or not), in the guest's namespace.
    return _stat_result(_fields(_call(_files.stat, name, bool(follow_symlinks),
                                      filename=path)))


def _lstat(path, *, dir_fd=None):
    return _os_stat(path, dir_fd=dir_fd, follow_symlinks=False, _function="lstat")


def _entries(function, path):
    text = _call(_files.readdir, _path(function, path), filename=path)
    return [(item[1:], _TAGS[item[0]]) for item in text.split("/")] if text else []


def _listdir(path=None):
    name = _convert("listdir", path, nullable=True)  # no descriptor, as on WASI
    names = [entry for entry, _ in _entries("listdir", "." if name is None else name)]
    if isinstance(name, bytes):
        return [os.fsencode(name) for name in names]
    return names


class DirEntry:
    """An os.DirEntry for a mounted directory (os.DirEntry cannot be made from Python)."""

    __slots__ = ("name", "path", "_kind", "_stat", "_lstat")

    def __init__(self, directory, name, kind):
        self.name = name
        self.path = posixpath.join(directory, name) if directory != "" else name
        self._kind = kind
        self._stat = self._lstat = None

    def is_dir(self, *, follow_symlinks=True):
        return self._is(_stat.S_IFDIR, follow_symlinks)

    def is_file(self, *, follow_symlinks=True):
        return self._is(_stat.S_IFREG, follow_symlinks)

    def _is(self, kind, follow_symlinks):
        if self._kind != _stat.S_IFLNK or not follow_symlinks:
            return self._kind == kind
        try:
            return _stat.S_IFMT(self.stat().st_mode) == kind
        except FileNotFoundError:
            return False  # a dangling link, as os.DirEntry answers

    def is_symlink(self):
        return self._kind == _stat.S_IFLNK

    def is_junction(self):
        return False

    def stat(self, *, follow_symlinks=True):
        if follow_symlinks:
            if self._stat is None:
                self._stat = _os_stat(self.path)
            return self._stat
        if self._lstat is None:
            self._lstat = _lstat(self.path)
        return self._lstat

    def inode(self):
        return self.stat(follow_symlinks=False).st_ino

    def __fspath__(self):
        return self.path

    def __repr__(self):
        return f"<DirEntry {self.name!r}>"

    def __reduce__(self):  # os.DirEntry cannot be pickled or copied either
        raise TypeError(f"cannot pickle {type(self).__name__!r} object")


class _ScandirIterator:
    """os.scandir's iterator: dropped before its end without ``close()``, it warns with a
    ResourceWarning, as CPython's does (its directory stream stays open until then)."""

    def __init__(self, entries):
        self._entries = iter(entries)
        self._open = True

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._entries)
        except StopIteration:
            self._open = False
            raise

    def close(self):
        self._entries = iter(())
        self._open = False

    def __del__(self):
        if self._open:
            warnings.warn(f"unclosed scandir iterator {self!r}", ResourceWarning, 2,
                          source=self)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _scandir(path=None):
    name = _convert("scandir", path, nullable=True)  # no descriptor, as on WASI
    name = "." if name is None else name
    entries = _entries("scandir", name)
    if isinstance(name, bytes):
        text = os.fsdecode(name)
        made = [DirEntry(text, entry, kind) for entry, kind in entries]
        for entry in made:
            entry.name, entry.path = os.fsencode(entry.name), os.fsencode(entry.path)
        return _ScandirIterator(made)
    return _ScandirIterator([DirEntry(name, entry, kind) for entry, kind in entries])


def _mkdir(path, mode=0o777, *, dir_fd=None):
    _no_dir_fd(dir_fd, "mkdir")
    _call(_files.mkdir, _path("mkdir", path), mode & 0o7777, filename=path)


def _unlink(path, *, dir_fd=None, _function="unlink"):
    _no_dir_fd(dir_fd, _function)
    _call(_files.unlink, _path(_function, path), filename=path)


def _remove(path, *, dir_fd=None):  # os.unlink under the name its errors give
    _unlink(path, dir_fd=dir_fd, _function="remove")


def _rmdir(path, *, dir_fd=None):
    _no_dir_fd(dir_fd, "rmdir")
    _call(_files.rmdir, _path("rmdir", path), filename=path)


def _rename(src, dst, *, src_dir_fd=None, dst_dir_fd=None, _function="rename"):
    _no_dir_fd(src_dir_fd, _function)
    _no_dir_fd(dst_dir_fd, _function)
    _call(_files.rename, _path(_function, src, "src"), _path(_function, dst, "dst"),
          filename=src, filename2=dst)


def _replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):  # os.rename, named replace
    _rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, _function="replace")


def _chmod(path, mode, *, dir_fd=None, follow_symlinks=True):
    _no_dir_fd(dir_fd, "chmod")
    name = _path("chmod", path)
    if not follow_symlinks and _stat.S_ISLNK(_lstat(name).st_mode):
        # As CPython on Linux, where fchmodat cannot change a link's own mode.
        raise NotImplementedError("chmod: follow_symlinks unavailable on this platform")
    _call(_files.chmod, name, mode & 0o7777, filename=path)


def _seconds_ns(value):
    """A time in seconds (int or float) as integer nanoseconds, rounded down as CPython's
    utime rounds it. Raises TypeError, ValueError (NaN) or OverflowError as CPython does."""
    if isinstance(value, float):
        if math.isnan(value):
            raise ValueError("Invalid value NaN (not a number)")
        fraction, whole = math.modf(value)
        if not -_S64 <= whole < _S64:
            raise OverflowError("timestamp out of range for platform time_t")
        return int(whole) * 10**9 + math.floor(fraction * 1e9)
    return _ns_of(operator.index(value) * 10**9)


def _ns_of(value):
    """Nanoseconds from an object of ``ns``: split with divmod, as CPython splits it."""
    parts = divmod(value, 10**9)
    if not isinstance(parts, tuple) or len(parts) != 2:
        raise TypeError(f"{type(value).__name__}.__divmod__() must return a 2-tuple, not "
                        f"{type(parts).__name__}")
    seconds, nanoseconds = operator.index(parts[0]), operator.index(parts[1])
    if not -_S64 <= seconds * 10**9 + nanoseconds < _S64:
        raise OverflowError("timestamp out of range for platform time_t")
    return seconds * 10**9 + nanoseconds


def _utime(path, times=None, *, ns=None, dir_fd=None, follow_symlinks=True):
    name = _path("utime", path)
    _no_dir_fd(dir_fd, "utime")
    if times is not None and ns is not None:
        raise ValueError("utime: you may specify either 'times' or 'ns' but not both")
    if times is not None:
        if type(times) is not tuple or len(times) != 2:
            raise TypeError("utime: 'times' must be either a tuple of two ints or None")
        (atime, mtime), now = (_seconds_ns(value) for value in times), False
    elif ns is not None:
        if type(ns) is not tuple or len(ns) != 2:
            raise TypeError("utime: 'ns' must be a tuple of two ints")
        (atime, mtime), now = (_ns_of(value) for value in ns), False
    else:
        # The host sets the run's clock's time: the virtual one unless it grants the real.
        atime = mtime = 0
        now = True
    _call(_files.utime, name, atime, mtime, now, bool(follow_symlinks), filename=path)


def _link(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
    _call(_files.link, _path("link", src, "src"), _path("link", dst, "dst"), filename=src,
          filename2=dst)


def _symlink(src, dst, target_is_directory=False, *, dir_fd=None):
    _no_dir_fd(dir_fd, "symlink")
    target = os.fsdecode(_convert("symlink", src, "src"))
    # Stored as given: the host reads it back only to resolve it in this guest's namespace.
    _call(_files.symlink, target, _path("symlink", dst, "dst"), filename=src, filename2=dst)


def _readlink(path, *, dir_fd=None):
    _no_dir_fd(dir_fd, "readlink")
    name = _convert("readlink", path)
    target = _call(_files.readlink, _path("readlink", name), filename=path)
    return os.fsencode(target) if isinstance(name, bytes) else target


def _access(path, mode, *, dir_fd=None, effective_ids=False, follow_symlinks=True):
    try:  # a TypeError or ValueError of the path is raised, not "no access"
        st = _os_stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks, _function="access")
    except OSError:
        return False
    if mode & os.W_OK and not st.st_mode & 0o222:
        return False
    if mode & os.R_OK and not st.st_mode & 0o444:
        return False
    return not (mode & os.X_OK and not st.st_mode & 0o111)


def _truncate(path, length):
    name = _path("truncate", path, allow_fd=True)
    if isinstance(name, int):
        return _ftruncate(name, length)
    length = _int64(length)
    if length < 0:
        raise _error(_files.ErrorCode.INVAL, path)  # before the path, as Linux checks
    fd = _os_open(path, os.O_WRONLY)
    try:
        _ftruncate(fd, length)
    finally:
        _close(fd)


def _getcwd():
    return _cwd


def _getcwdb():
    return os.fsencode(_cwd)


def _chdir(path):
    global _cwd
    target = _path("chdir", path)  # no descriptor, as on WASI
    if _fields(_call(_files.stat, target, True, filename=path))[0] != _DIRECTORY:
        raise _error(_files.ErrorCode.NOTDIR, path)
    # Where the path leads, links resolved, as getcwd() reports it on Linux: a later ".."
    # is the parent of that directory.
    _cwd = posixpath.realpath(target)


# -- open() ---------------------------------------------------------------------------------

class FileIO(io.RawIOBase):
    """io.FileIO over the host's mounts: raw, unbuffered I/O on a descriptor the host gave
    this run, or on a path it opens (same arguments and errors as io.FileIO).

    A descriptor the host did not give (stdio) gets the original io.FileIO.
    """

    def __new__(cls, file, mode="r", closefd=True, opener=None, *, _name=None):
        if isinstance(file, int) and file not in _fds:
            return _RealFileIO(file, mode, closefd, opener)
        return super().__new__(cls)

    def __init__(self, file, mode="r", closefd=True, opener=None, *, _name=None):
        self._fd, self._closefd = -1, closefd  # what close() needs, should __init__ fail
        super().__init__()
        if not isinstance(mode, str):
            raise TypeError(f"FileIO() argument 'mode' must be str, not {type(mode).__name__}")
        modes = set(mode)
        if modes - set("rwxab+") or len(mode) > len(modes) or \
                len(modes & set("rwxa")) != 1:
            raise ValueError(f"invalid mode: {mode}")
        kind, updating = (modes & set("rwxa")).pop(), "+" in modes
        if isinstance(file, int):
            fd, name = file, file if _name is None else _name
        else:
            fd, name = _open_path(file, kind, updating, closefd, opener), file
            if not isinstance(fd, int) or fd not in _fds:  # an opener's other descriptor
                raise OSError(errno.EBADF, os.strerror(errno.EBADF), file)
        self._fd = fd
        self.name = name
        # As CPython names it: a file opened to read and write is "rb+", however opened
        # ("w+" truncated it first; "a+" and "x+" keep their letter).
        self.mode = ("r" if kind == "w" and updating else kind) + ("b+" if updating else "b")
        self._readable = kind == "r" or updating
        self._writable = kind != "r" or updating

    def readable(self):
        self._checkClosed()
        return self._readable

    def writable(self):
        self._checkClosed()
        return self._writable

    def seekable(self):
        self._checkClosed()
        return True

    def isatty(self):
        self._checkClosed()
        return False

    def fileno(self):
        self._checkClosed()
        return self._fd

    @property
    def closefd(self):
        return self._closefd

    def readinto(self, buffer):
        self._checkClosed()
        if not self._readable:
            raise io.UnsupportedOperation("File not open for reading")
        view = memoryview(buffer).cast("B")
        data = _read(self._fd, len(view))
        view[:len(data)] = data
        return len(data)

    def readall(self):
        self._checkClosed()
        if not self._readable:
            raise io.UnsupportedOperation("File not open for reading")
        chunks = []
        while chunk := _read(self._fd, _READ_ALL_CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)

    def write(self, data):
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("File not open for writing")
        return _write(self._fd, data)

    def seek(self, position, whence=0):
        self._checkClosed()
        return _lseek(self._fd, position, whence)

    def tell(self):
        return self.seek(0, 1)

    def truncate(self, size=None):
        self._checkClosed()
        if not self._writable:
            raise io.UnsupportedOperation("File not open for writing")
        if size is None:
            size = self.tell()
        _ftruncate(self._fd, size)
        return size

    def close(self):
        if self.closed:
            return
        try:
            super().close()
        finally:
            if self._closefd and self._fd in _fds:
                _close(self._fd)

    def __repr__(self):
        return f"<wasibox FileIO name={self.name!r} mode={self.mode!r}>"


def _open_path(file, kind, updating, closefd, opener):
    """A descriptor for ``file`` opened in ``kind`` ("r", "w", "x" or "a") mode, as open()
    and io.FileIO open it; an ``opener``'s descriptor is returned unchecked."""
    if not isinstance(file, (str, bytes, os.PathLike)):
        raise TypeError(f"expected str, bytes or os.PathLike object, not {type(file).__name__}")
    name = os.fspath(file)  # FileIO's own check, with its message (not path_t's)
    if ("\x00" if isinstance(name, str) else b"\x00") in name:
        raise ValueError("embedded null byte")
    if not closefd:
        raise ValueError("Cannot use closefd=False with file name")
    flags = os.O_RDWR if updating else os.O_RDONLY if kind == "r" else os.O_WRONLY
    flags |= {"r": 0, "w": os.O_CREAT | os.O_TRUNC, "x": os.O_CREAT | os.O_EXCL,
              "a": os.O_CREAT | os.O_APPEND}[kind]
    if opener is not None:
        return opener(file, flags)
    return _os_open(file, flags, 0o666, _extra=_F_NOTDIR)  # the host refuses a directory


def _open_code(path):
    """io.open_code: how importlib, runpy and zipimport read code (a binary reader)."""
    if not isinstance(path, str):
        raise TypeError(f"open_code() argument 'path' must be str, not {type(path).__name__}")
    return _open(path, "rb")


def _open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,
          closefd=True, opener=None):
    """builtins.open / io.open over the host's mounts (same arguments and errors)."""
    if isinstance(file, int) and file not in _fds:
        return _real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    if not isinstance(mode, str):
        raise TypeError(f"open() argument 'mode' must be str, not {type(mode).__name__}")
    modes = set(mode)
    if modes - set("axrwb+t") or len(mode) > len(modes):
        raise ValueError(f"invalid mode: {mode!r}")
    creating, reading, writing, appending = ("x" in modes, "r" in modes, "w" in modes,
                                             "a" in modes)
    updating, text, binary = "+" in modes, "t" in modes, "b" in modes
    if text and binary:
        raise ValueError("can't have text and binary mode at once")
    if creating + reading + writing + appending != 1:
        raise ValueError("must have exactly one of create/read/write/append mode")
    if binary and encoding is not None:
        raise ValueError("binary mode doesn't take an encoding argument")
    if binary and errors is not None:
        raise ValueError("binary mode doesn't take an errors argument")
    if binary and newline is not None:
        raise ValueError("binary mode doesn't take a newline argument")
    if binary and buffering == 1:
        buffering = -1
    if buffering == 0 and not binary:
        raise ValueError("can't have unbuffered text I/O")
    raw_mode = ("x" if creating else "r" if reading else "w" if writing else "a") + \
        ("b+" if updating else "b")
    if isinstance(file, int):
        fd, name = file, file
    else:
        name = file
        fd = _open_path(file, raw_mode[0], updating, closefd, opener)
        if not isinstance(fd, int) or fd not in _fds:
            return _real_open(fd, mode, buffering, encoding, errors, newline, closefd)
    raw = FileIO(fd, raw_mode, closefd, _name=name)
    try:
        if (isinstance(file, int) or opener is not None) and _stat.S_ISDIR(_fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
        if appending:
            raw.seek(0, 2)
        line_buffering = buffering == 1
        if buffering in (-1, 1):
            buffering = _BUFFER_SIZE
        if buffering == 0:
            result = raw
        elif updating:
            result = io.BufferedRandom(raw, buffering)
        elif reading:
            result = io.BufferedReader(raw, buffering)
        else:
            result = io.BufferedWriter(raw, buffering)
        if not binary:
            result = io.TextIOWrapper(result, encoding, errors, newline, line_buffering)
            result.mode = mode
    except BaseException:
        raw.close()
        raise
    _opened.add(result)
    return result


# -- installing, and the end of a run ----------------------------------------------------------

_PATCHES = {
    "open": _os_open, "read": _read, "readinto": _readinto, "write": _write, "close": _close, "lseek": _lseek,
    "pread": _pread, "pwrite": _pwrite, "dup": _dup,
    "fstat": _fstat, "ftruncate": _ftruncate, "fsync": _fsync, "fdatasync": _fdatasync,
    "isatty": _isatty, "get_blocking": _get_blocking, "set_blocking": _set_blocking,
    "stat": _os_stat, "lstat": _lstat, "listdir": _listdir,
    "scandir": _scandir, "mkdir": _mkdir, "unlink": _unlink, "remove": _remove,
    "rmdir": _rmdir, "rename": _rename, "replace": _replace, "chmod": _chmod, "utime": _utime,
    "link": _link, "symlink": _symlink, "readlink": _readlink, "access": _access,
    "truncate": _truncate, "getcwd": _getcwd, "getcwdb": _getcwdb, "chdir": _chdir,
}


def install():
    """Route open(), io.open and the os file functions through the host (once, at pre-init)."""
    # Each replacement is wrapped in a staticmethod, which is callable and, unlike a plain
    # function, never becomes a bound method: the originals are built-ins, and code keeps
    # them as class attributes (``_unlink = os.unlink`` ... ``self._unlink(name)``).
    patches = {name: staticmethod(function) for name, function in _PATCHES.items()}
    _real.update((name, getattr(os, name)) for name in patches if hasattr(os, name))
    # By id, each with its original, which keeps the original alive (and its id unused).
    replaced = {id(original): (original, patches[name]) for name, original in _real.items()}
    for name, patch in patches.items():
        setattr(os, name, patch)
        # importlib calls posix directly (its ``_os``); so does linecache's stat via os.
        if hasattr(posix, name):
            setattr(posix, name, patch)
    opener = staticmethod(_open)
    builtins.open = io.open = _io.open = tokenize._builtin_open = opener
    io.open_code = _io.open_code = staticmethod(_open_code)
    io.FileIO = _io.FileIO = FileIO
    os.DirEntry = DirEntry
    # The originals support dir_fd and fd arguments; these do not, and library code
    # (shutil, glob, pathlib) asks these sets before trying.
    os.supports_dir_fd = set()
    os.supports_fd = {patches["stat"], patches["truncate"]}
    os.supports_follow_symlinks = {patches[name] for name in ("stat", "access", "utime",
                                                              "chmod")}
    os.supports_effective_ids = set()
    _rebind_defaults(replaced)


def _rebind_defaults(replaced):
    """Point default arguments that captured an original os function at its replacement.

    Modules imported before ``install`` (at pre-init) bound some as defaults, such as
    tempfile's ``unlink=_os.unlink``: without this, NamedTemporaryFile never removed its
    file from a mount. Module-level functions and the methods of module-level classes.
    """
    def swap(value):
        original, replacement = replaced.get(id(value), (None, None))
        return replacement if original is value else value

    def rebind(function):
        if not isinstance(function, types.FunctionType):
            return
        defaults = function.__defaults__
        if defaults and any(swap(value) is not value for value in defaults):
            function.__defaults__ = tuple(swap(value) for value in defaults)
        for key, value in (function.__kwdefaults__ or {}).items():
            if swap(value) is not value:
                function.__kwdefaults__[key] = swap(value)

    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if isinstance(value, type):
                for member in list(vars(value).values()):
                    rebind(getattr(member, "__func__", member))
            else:
                rebind(value)


def flush_open():
    """Flush what the program left open without closing it (between a session's calls, whose
    files stay open). Raises the first error, as ``finish`` does."""
    # Most runs open nothing: iterating an empty WeakSet cost ~10K fuel. Its ``data`` set is
    # tested, not the WeakSet, whose ``__len__`` looks up ``len``, which the program may
    # have deleted (a one-shot run does not restore the builtins: see wasibox_job.run_job).
    if not _opened.data:
        return
    failure = None
    for handle in list(_opened):
        try:
            if not handle.closed:
                handle.flush()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def finish(session=False):
    """Close what the program left open, so buffered writes reach the host before it
    decides what to publish; after a session's call (``session``), only flush it, as its
    files stay open for its next call. Raises the first error (a flush that hit the quota):
    a file that could not be written whole must fail the run, so it is not published."""
    if session:
        flush_open()
        return
    if not _opened.data and not _fds:  # most runs open nothing: see flush_open
        return
    failure = None
    for handle in list(_opened):
        try:
            handle.close()
        except BaseException as exc:
            failure = failure or exc
    for fd in list(_fds):
        try:
            _close(fd)
        except BaseException:
            pass
    if failure is not None:
        raise failure

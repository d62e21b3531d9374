"""The standard library and the package set, packed into the snapshot, and the finder that
imports them at run time.

componentize-py mounts the stdlib (at ``/python``) only while it snapshots the interpreter,
so importing this module, at build time, compiles every stdlib module (and every module of
the package set, if the guest has one) into marshalled code objects held in memory, with
their data files. ``install()`` then makes that the import system's source: the stdlib
mount is gone at run time, and the file system holds only the run's mounts.

This file never imports the host package: it is the other side of a trust boundary.
"""

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import marshal
import os
import sys
import zlib

__all__ = ["UNAVAILABLE", "import_package_set", "install"]

_STDLIB_ROOT = "/python"
# Packages that are never packed: tests, GUI, and tooling that cannot run under WASI.
_SKIP_DIRS = frozenset({
    "__pycache__", "site-packages", "test", "tests", "idlelib", "tkinter", "turtledemo",
    "ensurepip", "venv", "lib2to3", "pydoc_data",
})
# Modules that exist in the stdlib but cannot work without an OS process model, native
# libraries or a terminal. Importing one raises a clear ImportError instead of failing deep
# inside the module.
UNAVAILABLE = frozenset({
    "ctypes", "ssl", "bz2", "lzma", "multiprocessing", "concurrent.futures.process", "curses",
    "readline", "dbm.gnu", "dbm.ndbm", "tkinter", "turtle", "idlelib", "venv", "ensurepip",
    "_ctypes", "_ssl", "_bz2", "_lzma", "_curses", "_tkinter", "pty", "tty", "termios",
    "fcntl", "grp", "pwd", "resource", "mmap", "syslog",
})


def _pack_tree(root, prefix, skip, display_root="<stdlib>"):
    """Compile every module under ``root`` into ``{name: (is_package, marshalled code,
    file name, zlib-compressed source)}``; the file name, under ``display_root``, is the
    module's ``__file__``. The source is what tracebacks and ``inspect`` show."""
    table = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and "-" not in d and "." not in d)
        rel = os.path.relpath(dirpath, root)
        package = prefix if rel == "." else ".".join(filter(None, [prefix, *rel.split(os.sep)]))
        for filename in sorted(filenames):
            if not filename.endswith(".py"):
                continue
            stem = filename[:-3]
            is_package = stem == "__init__"
            name = package if is_package else ".".join(filter(None, [package, stem]))
            if not name or name in table:
                continue
            path = os.path.join(dirpath, filename)
            with open(path, "rb") as handle:
                source = handle.read()
            display = display_root + "/" + os.path.relpath(path, root)
            try:
                code = compile(source, display, "exec", dont_inherit=True)
            except SyntaxError:
                continue
            table[name] = (is_package, marshal.dumps(code), display, zlib.compress(source, 9))
    return table


def _pack_resources(root, prefix):
    """Read the data files of a package tree: ``{package: {file name: bytes}}``."""
    resources = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel = os.path.relpath(dirpath, root)
        package = prefix if rel == "." else ".".join([prefix, *rel.split(os.sep)])
        files = {}
        for filename in sorted(filenames):
            if filename.endswith((".py", ".pyc")):
                continue
            with open(os.path.join(dirpath, filename), "rb") as handle:
                files[filename] = handle.read()
        resources[package] = files
    return resources


_MODULES = _pack_tree(_STDLIB_ROOT, "", _SKIP_DIRS)
_RESOURCES = {}
for _entry in sys.path:
    # Bundled pure-Python data packages (tzdata, so zoneinfo has a time zone database).
    _tz = os.path.join(_entry, "tzdata")
    if _entry != _STDLIB_ROOT and os.path.isdir(_tz):
        _MODULES.update(_pack_tree(_tz, "tzdata", frozenset({"__pycache__"}), "<stdlib>/tzdata"))
        _RESOURCES.update(_pack_resources(_tz, "tzdata"))
        break

# -- build time: the package set --------------------------------------------------------------
#
# A guest built for a package set (wasibox/_packages.py) has the wheels' contents in a
# ``wasibox_site`` directory beside this file. They are packed like the stdlib, after it (a
# package never shadows a stdlib module), and imported below, once the run-time environment
# is in place, so the snapshot holds them imported.
_SITE_ROOT = "<packages>"
_SITE_TOP_LEVEL = []  # the importable top-level names of the package set, in order
_DISTRIBUTIONS = {}  # normalised project name -> {dist-info file name: bytes}


def _normalise(project):
    return "".join("_" if c in "-." else c for c in project).lower()


def _pack_site(site):
    for name in sorted(os.listdir(site)):
        path = os.path.join(site, name)
        if name.endswith(".dist-info") and os.path.isdir(path):
            project = name[: -len(".dist-info")].rpartition("-")[0]
            files = {}
            for filename in sorted(os.listdir(path)):
                if os.path.isfile(os.path.join(path, filename)):
                    with open(os.path.join(path, filename), "rb") as handle:
                        files[filename] = handle.read()
            _DISTRIBUTIONS.setdefault(_normalise(project), files)
        elif (name[:-3] if name.endswith(".py") else name) in _MODULES:
            continue  # the stdlib or a bundled package (tzdata) has it: theirs stays
        elif os.path.isdir(path) and name.isidentifier():
            if not os.path.isfile(os.path.join(path, "__init__.py")):
                # A namespace package: an empty package module holds its portions.
                _MODULES[name] = (True, marshal.dumps(compile("", name, "exec")),
                                  f"{_SITE_ROOT}/{name}/__init__.py")
            _MODULES.update(_pack_tree(path, name, frozenset({"__pycache__"}),
                                       f"{_SITE_ROOT}/{name}"))
            _RESOURCES.update(_pack_resources(path, name))
            _SITE_TOP_LEVEL.append(name)
        elif name.endswith(".py") and name[:-3].isidentifier() and os.path.isfile(path):
            with open(path, "rb") as handle:
                source = handle.read()
            display = f"{_SITE_ROOT}/{name}"
            try:
                code = compile(source, display, "exec", dont_inherit=True)
            except SyntaxError:
                continue
            _MODULES[name[:-3]] = (False, marshal.dumps(code), display)
            _SITE_TOP_LEVEL.append(name[:-3])


for _entry in sys.path:
    _site = os.path.join(_entry, "wasibox_site")
    if _entry != _STDLIB_ROOT and os.path.isdir(_site):
        _pack_site(_site)
        break


class _Resource:
    """A read-only ``importlib.resources`` Traversable over packed bytes."""

    def __init__(self, package, name, data):
        self._package = package
        self.name = name
        self._data = data

    def is_file(self):
        return self._data is not None

    def is_dir(self):
        return self._data is None

    def iterdir(self):
        if self._data is not None:
            return iter(())
        return (_Resource(self._package, n, d) for n, d in _RESOURCES.get(self._package, {}).items())

    def joinpath(self, *parts):
        if len(parts) != 1 or "/" in parts[0]:
            raise FileNotFoundError("/".join(parts))
        data = _RESOURCES.get(self._package, {}).get(parts[0])
        if data is None:
            raise FileNotFoundError(parts[0])
        return _Resource(self._package, parts[0], data)

    __truediv__ = joinpath

    def open(self, mode="r", *args, **kwargs):
        if self._data is None:
            raise IsADirectoryError(self.name)
        if "b" in mode:
            return io.BytesIO(self._data)
        return io.TextIOWrapper(io.BytesIO(self._data), *args, **kwargs)

    def read_bytes(self):
        return self.open("rb").read()

    def read_text(self, encoding=None):
        return self._data.decode(encoding or "utf-8")


class _ResourceReader:
    def __init__(self, package):
        self._package = package

    def files(self):
        return _Resource(self._package, self._package.rpartition(".")[2], None)


class _PackedFinder(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Imports stdlib modules from the code objects packed into the snapshot.

    A module gets a ``__file__`` (its packed name, ``<stdlib>/...``), as stdlib code such as
    ``_strptime`` expects. Loading goes through InspectLoader's ``exec_module``, which is
    importlib's own: no frame of this file sits between a module and its importer, so a
    warning a module raises at import time (``stacklevel=2``) names the importing line.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname in UNAVAILABLE or fullname.partition(".")[0] in UNAVAILABLE:
            raise ModuleNotFoundError(
                f"module {fullname!r} is not available in the wasibox sandbox "
                "(it needs native libraries or OS features that WebAssembly does not have)",
                name=fullname,
            )
        entry = _MODULES.get(fullname)
        if entry is None:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self, origin=entry[2],
                                              is_package=entry[0])
        spec.has_location = True  # so the import system sets __file__ from the origin
        return spec

    def create_module(self, spec):
        return None

    def get_code(self, fullname):
        return marshal.loads(_MODULES[fullname][1])

    def get_source(self, fullname):
        # Compressed, the stdlib's source adds about 1.7 MB to the snapshot.
        return importlib.util.decode_source(zlib.decompress(_MODULES[fullname][3]))

    def is_package(self, fullname):
        return _MODULES[fullname][0]

    def get_resource_reader(self, fullname):
        return _ResourceReader(fullname)

    def get_data(self, path):
        """A packed data file by the path its package's ``__file__`` implies (what
        ``pkgutil.get_data`` asks for); FileNotFoundError for any other path."""
        for root in (_SITE_ROOT + "/", "<stdlib>/"):
            if path.startswith(root):
                *package, name = path[len(root):].split("/")
                data = _RESOURCES.get(".".join(package), {}).get(name)
                if data is not None:
                    return data
        raise FileNotFoundError(2, "No such file or directory", path)

    def find_distributions(self, context=None):
        """The package set's distributions, for ``importlib.metadata`` (versions, entry
        points); the dist-info files were packed at build time."""
        wanted = getattr(context, "name", None)
        for project, files in _DISTRIBUTIONS.items():
            if wanted is None or _normalise(wanted) == project:
                yield _distribution_class()(files)


@functools.cache
def _distribution_class():
    """The Distribution type for packed dist-info files. Made on first use: importlib.metadata
    is the caller then, and a guest without packages never imports it."""
    import importlib.metadata

    class PackedDistribution(importlib.metadata.Distribution):
        def __init__(self, files):
            self._files = files

        def read_text(self, filename):
            data = self._files.get(filename)
            return None if data is None else data.decode("utf-8", "replace")

        def locate_file(self, path):
            return f"{_SITE_ROOT}/{path}"

    return PackedDistribution


def install():
    """Import from memory from now on; once, at build time, after the modules the snapshot
    holds imported were imported.

    The stdlib's mount disappears after the snapshot. The file system holds only the run's
    mounts (wasibox_files.py), and sys.path starts as ``python -c`` starts it, with "" (the
    current directory, "/" unless the program changes it), so the path importer finds only
    what is in the current directory or a run puts on sys.path (the job's ``path``, or the
    program's own sys.path.insert), and reads it through the same mounts as open(). The packed
    stdlib comes first, so a user module cannot shadow a stdlib one.
    """
    finder = _PackedFinder()
    sys.meta_path[:] = [
        importlib.machinery.BuiltinImporter,
        importlib.machinery.FrozenImporter,
        finder,
        importlib.machinery.PathFinder,
    ]
    sys.path[:] = [""]
    sys.path_hooks[:] = [importlib.machinery.FileFinder.path_hook(
        (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
        (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES))]
    sys.path_importer_cache.clear()
    sys.dont_write_bytecode = True
    # The modules imported so far were read from the stdlib's mount, and their loaders would
    # read it again for their source (tracebacks, inspect): point them at the packed copy.
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.name in _MODULES and isinstance(
                spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = module.__loader__ = finder


def import_package_set():
    """Import the package set's modules now, so a run pays nothing to import them (a run that
    imported dateutil.parser itself spent ~80 M fuel on it); once, at build time, after the
    run-time environment is in place.

    Test suites and __main__ modules are left out. One that fails to import here (it needs
    something WASI lacks, or an optional dependency) stays unimported: a run that imports it
    gets the same error, with its traceback, instead of the whole set failing.
    """
    # The path importer is kept out of it: at build time the files capability is a trapping
    # stub, and a package's optional imports (``try: import x``) would ask it about "" on
    # sys.path.
    sys.path[:] = []
    for name in sorted(name for name in _MODULES if name.partition(".")[0] in _SITE_TOP_LEVEL):
        if {"__main__", "test", "tests"} & set(name.split(".")) or name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]
    sys.path[:] = [""]
    sys.path_importer_cache.clear()

"""The host side of the ``files`` capability: mounts, the guest's file operations, staging
and publishing.

**The threat it mediates.** Guest code is hostile and may try to read or change host files
outside what it was granted: by ``..`` traversal, absolute or relative symlinks, trailing-slash
tricks, hard links, or by racing, filling or planting things in a directory the host later
trusts. It may also try to exhaust the host: disk space, inodes, file descriptors. And a run
that dies half-way must not leave half-written files behind for the host to consume.

**Why the host mediates every operation (and not WASI preopens).** Wasmtime's own WASI
filesystem confines paths well, but it cannot give a byte or file-count quota the guest sees
as ``ENOSPC``/``EDQUOT``, a per-run cap on open files (``EMFILE``), per-run staging with a
publish step, refusal of planted links/FIFOs/devices, or an audit of what was written. So the
guest gets *no* preopens at all, and the guest runner routes ``open``, ``os.*`` and everything
built on them (pathlib, csv over files, shutil, os.walk, tempfile) through the ``files``
interface (``guest/wit/files.wit``); everything here is ordinary host Python, checked
before it touches the disk. Bypassing the guest's Python-level patches reaches nothing: there
is no WASI directory to reach. The exception is a ``c_access`` mount, which C code (sqlite3)
needs: it is also preopened, but only as the run's private staging tree of copies, and what
it holds is checked when the run ends (docs/c-level-files.md).

The price, measured with ``bench/files.py`` on a shared, loaded 2-core machine (so the
figures moved between runs): reading through the host in 64 KiB chunks ran at 8-28 MB/s
against 80-380 MB/s for a WASI preopen (0.06-0.36x; ASCII text is the fast end), and a run
writing and publishing 100 small files spent ~18-25 ms per file, most of it three host calls
and an fsync. Most runs that use files read a few CSV or JSON files; for those this is
milliseconds, and it buys the guarantees above.

File data crosses as a latin-1 string, as the ``stdio`` capability's does: wasmtime-py lowers
a ``list<u8>`` one element at a time; base64 and hex cost the guest as much fuel to decode as
latin-1 costs it to lift for random bytes (~60 fuel a byte: bytes >= 0x80 are two bytes of
UTF-8), and ten times more for ASCII text, which latin-1 passes through unchanged (~6). A
``stat`` travels as a string too: lowering a record field by field cost about three calls.

**Confinement.** A guest path is made absolute and resolved one component at a time, as
Linux resolves it, but in the guest's namespace: above the mounts, the names of the mount
table; inside a mount, each component opened relative to its parent's directory descriptor
with ``O_NOFOLLOW``, so the OS never follows a link. ``..`` is the parent of what the path
has reached. A symbolic link met on the way (or at the end, where the operation follows it)
is read by the host with ``readlink`` and its target spliced into the rest of the path: a
relative target from the link's directory, an absolute one from the guest's root. So no
link, whoever made it, can lead anywhere but into the mounts (the host's ``/etc/passwd`` is
the guest's, which does not exist); a lookup follows at most 40 links (``ELOOP``); a
trailing ``/`` demands a directory. Opening anything that is not a
regular file or directory (FIFO, device, socket) is refused with ``ENXIO``, and it is opened
``O_NONBLOCK`` first, so a planted FIFO cannot hang the host. Read-only mounts refuse every
mutation with ``EROFS``: writing, ``O_TRUNC``, create, delete, rename, ``chmod``, ``utime``,
``mkdir``, ``symlink``. Guests cannot make hard links (``EPERM``), so nothing can be
hard-linked out of a read-only mount into a writable one; they make symbolic links on a
writable mount, each counted as a file.

**Staging and publishing.** A writable mount's guest view is a per-run staging tree inside
the mount's host directory (``<mount>/.wasibox-staging/run-*/tree``, hidden from the guest;
inside, so every publish is a same-filesystem ``rename``). The staging directory stays,
with its two lock files and a ``README.txt`` that tells a user what it is; removing it when
idle would race a concurrent session that has it open. At the start of a run the tree is
populated with hard links to the mount's current files (one ``link`` per file, no data copied)
and the inode of each is remembered. A file shared with the host this way is copied before
anything changes it (write, truncate, ``chmod``, ``utime``), so the host's file is never
touched during the run; descriptors already open on it move to the copy, so all of them see
one file, as on a real filesystem. When the run ends **ok** (exit status 0, no exception, no
limit), :meth:`FileSession.publish` walks the tree without following anything and:

* measures what the tree holds and, if that is over the mount's quotas, publishes nothing
  (``_sandbox.run_with_files`` makes the run fail with an ``OSError``): this holds a backend whose
  guest writes the tree itself to the same quotas, and trusts no count kept during the run;
* refuses, and reports in ``RunResult.files_refused``, every symlink (the guest's own too:
  the host's programs would follow it with the OS, not in the guest's namespace), FIFO,
  device or socket, and every file hard-linked to an inode that was not in the mount at
  the start (the wasm guest cannot make those, but a backend whose guest writes the
  staging tree directly can);
* writes a journal, then moves each new or changed file into the host directory with one
  ``rename`` (the file appears complete or not at all), creating host directories component
  by component, again never following a link; then removes what the guest deleted, if the
  host still holds the same inode there (first, where the guest put a directory in place of
  a file or the reverse: the old entry must go before the new one can take its place);
* returns a :class:`FileRecord` (guest path, size, sha256) for each file it published.

Any other ending (an exception, a non-zero exit, a limit, a timeout, a cancel, a host error)
discards the staging tree. A host process that dies mid-run leaves a staging directory whose
lock is no longer held: the next session on that mount reclaims it, finishing the publish if
its journal was written, discarding it otherwise. Concurrent runs on one mount stage
separately and publish one at a time (a lock file), each file last-writer-wins; a reader of
the host directory sees each file old or new, never partial, though a multi-file publish is
not one atomic step.

**Limits.** Each writable mount has a byte quota (the sum of its regular files' sizes; a write
or truncate that would pass it writes what fits, then fails with ``ENOSPC``) and a file-count
quota (files plus directories; ``EDQUOT``). Both count files, not names (``_Inode``): a file is
counted while a name links to it or a descriptor holds it open, as a filesystem counts an
inode, so a file unlinked or replaced while open still counts until its last descriptor is
closed, and renames, replaces and truncation through any descriptor can never credit the same
bytes twice. A mount that already holds more than its quotas may shrink, but not grow.
Descriptors opened to append are ``O_APPEND`` on the host: the kernel puts each write at the
end of the file, whatever the descriptor's position, and two of them interleave.
Each run may hold at most ``Limits.open_files`` descriptors
(``EMFILE``), so one run cannot take the host's descriptors from another; the host holds one
directory descriptor per mount and one per open guest file, and closes all of them at the
end of the run.

**Where each part lives.** ``mount.py`` holds :class:`Mount` and the checks on a mount
table; ``session.py`` the guest's file operations during one run (:class:`FileSession`);
``staging.py`` a writable mount's staging tree, quota accounting, journal, publishing and
reclaiming; ``walk.py`` the one confinement walker with which the session, publishing, the
microVM's copy of a mount and the MCP server's workspace tools open directories by path.

This package is backend-agnostic: it knows nothing about wasmtime. A backend exposes the
``FileSession`` operations to its guest (the wasm backend as host functions); a backend whose
guest writes to a real directory can share :attr:`FileSession.trees` with it and reuse
``publish``, whose refusals exist for exactly that case.
"""

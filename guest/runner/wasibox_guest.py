"""The guest runner: the Python code that runs inside the sandbox.

componentize-py imports this module once, at build time, and snapshots the interpreter right
after. Everything at module level therefore runs *once per build*, never per run: it imports a
curated set of stdlib modules, packs the rest of the stdlib into memory
(``wasibox_packed.py``), and puts the run-time environment in place (the host's clock,
entropy, output and exit; no sockets or threads; files through ``wasibox_files.py``). Each run
then starts from that snapshot in a fresh instance and calls ``execute``, which decodes the
job and runs it: a run, call or compile job with the job core the microVM agent shares
(``wasibox_job.py``), a batch with ``wasibox_batch.py``.

This file never imports the host package: it is the other side of a trust boundary. The wire
shapes it speaks are documented in ``wasibox/_wire.py``.
"""

import binascii
import codecs
import gc
import io
import linecache
import marshal
import operator
import os
import sys

import wasibox_batch
import wasibox_files
import wasibox_job
import wit_world
from wit_world.imports import clock as _clock
from wit_world.imports import entropy as _entropy
from wit_world.imports import process as _process
from wit_world.imports import runner as _runner
from wit_world.imports import stdio as _stdio


# The guest's `import host`: host functions and mediated HTTP (guest/runner/host/). Installing
# its urllib handler now means urlopen goes through the host in every run.
import host
host.http.install()

# -- build time: the standard library -------------------------------------------------------

# Imported now so they cost nothing at run time: the common data-processing modules.
import asyncio  # noqa: F401
import base64  # noqa: F401
import bisect  # noqa: F401
import collections  # noqa: F401
import csv  # noqa: F401
import dataclasses  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import email  # noqa: F401
import email.message  # noqa: F401
import email.parser  # noqa: F401
import enum  # noqa: F401
import fractions  # noqa: F401
import functools  # noqa: F401
import hashlib  # noqa: F401
import heapq  # noqa: F401
import html  # noqa: F401
import itertools  # noqa: F401
import json  # noqa: F401
import math  # noqa: F401
import random  # noqa: F401
import re  # noqa: F401
import select  # noqa: F401
import selectors  # noqa: F401
import sqlite3  # noqa: F401
import statistics  # noqa: F401
import string  # noqa: F401
import struct  # noqa: F401
import textwrap  # noqa: F401
import time  # noqa: F401
import tomllib  # noqa: F401
import typing  # noqa: F401
import unicodedata  # noqa: F401
import urllib.parse  # noqa: F401
import uuid  # noqa: F401
import xml.etree.ElementTree  # noqa: F401
import zlib  # noqa: F401
import zoneinfo  # noqa: F401

# isort: split
# From here on, the stdlib comes from memory (its mount is gone at run time); the modules
# imported so far read their source from the packed copy too.
import wasibox_packed  # noqa: E402

wasibox_packed.install()


# -- build time: the run-time environment ---------------------------------------------------


# The builtins the output streams and ``_heap_top`` use, bound here: they run after the
# program, which may have deleted or replaced the builtins (a one-shot run does not put them
# back, see wasibox_job.run_job), and its output and reply must not depend on that.
_bytes, _id, _len, _MemoryError = bytes, id, len, MemoryError


class _HostStream(io.RawIOBase):
    """Raw bytes to the host's bounded output sink, one char per byte."""

    def __init__(self, fd):
        self._fd = fd

    def writable(self):
        return True

    def write(self, data, _decode=codecs.latin_1_decode, _write=_stdio.write):
        # The buffer's memoryview decoded as it is (C, one call), with the import bound:
        # ~3K fuel less per flush than copying it to bytes first and looking both up.
        text, size = _decode(data)
        if size:
            _write(self._fd, text)
        return size


def _new_stream(fd, line_buffering):
    # The text layer sits on a BufferedWriter, as a native CPython's stdout on a pipe does.
    # Without it a paced run's call was ~0.01 ms cheaper (~6K fuel), but every write a
    # program makes to ``sys.stdout.buffer`` would cross to the host on its own: a program
    # writing its output line by line as bytes would pay a crossing (~8K fuel) per line.
    buffered = io.BufferedWriter(_HostStream(fd), buffer_size=8192)
    return io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace",
                            line_buffering=line_buffering)


def _sleep(seconds):
    """time.sleep, routed through the host so the run's deadline still applies."""
    seconds = float(seconds)
    if seconds < 0:
        raise ValueError("sleep length must be non-negative")
    if seconds != seconds:
        raise ValueError("Invalid value NaN (not a number)")
    if seconds > 0:
        _clock.sleep(min(int(seconds * 1e9), 2**64 - 1))


_real_select = select.select


def _select(rlist, wlist, xlist, timeout=None):
    """select.select: a pure wait goes through the host; nothing else can block here."""
    if not rlist and not wlist and not xlist:
        if timeout is None:
            raise OSError(22, "select() with no file descriptors and no timeout would block forever")
        _sleep(timeout)
        return [], [], []
    return _real_select(rlist, wlist, xlist, 0)


def _urandom(size):
    """os.urandom, served by the host's entropy capability (seeded unless granted real).

    Fails fast as CPython's does: OverflowError past a C ssize_t, MemoryError when the
    result cannot be allocated, before a single byte is asked of the host.
    """
    size = operator.index(size)
    if size < 0:
        raise ValueError("negative argument not allowed")
    if size > sys.maxsize:
        raise OverflowError("Python int too large to convert to C ssize_t")
    buffer = bytearray(size)  # MemoryError now, not after minutes of 1 MiB host calls
    view = memoryview(buffer)
    done = 0
    while done < size:
        step = min(size - done, 1 << 20)
        view[done:done + step] = _entropy.random_bytes(step).encode("latin-1")
        done += step
    view.release()
    return bytes(buffer)


_random_seed = random.Random.seed


def _seed(self, a=None, version=2):
    """random.Random.seed: seeding from entropy draws 32 bytes, not MT's 2,496."""
    if a is None:
        a = int.from_bytes(_urandom(32), "little")
    _random_seed(self, a, version)


def _exit(status):
    """os._exit: end the run at once with this status, without cleanup (as on a real OS).

    The status converts as CPython's does (a C int: TypeError for a float, OverflowError
    past 32 bits); a Linux parent then sees its low 8 bits.
    """
    status = operator.index(status)
    if not -2**31 <= status < 2**31:
        raise OverflowError("Python int too large to convert to C int")
    _process.exit(int.__and__(status, 0xFF))


time.sleep = _sleep
select.select = _select
if hasattr(select, "poll"):
    # poll() would reach WASI's blocking poll, which ignores the deadline.
    del select.poll
selectors.DefaultSelector = selectors.SelectSelector
# SelectSelector captured select.select when the class was made; point it at the wrapper.
selectors.SelectSelector._select = lambda self, r, w, x, timeout=None: _select(r, w, x, timeout)
os._exit = _exit
os.urandom = random._urandom = _urandom
random.Random.seed = _seed
random.seed = random._inst.seed  # the module function is a method bound at import time


def _no_self_pipe(loop):
    """asyncio's self-pipe wakes a loop from other threads through a socketpair. WASI has no
    threads and no socketpair, so the loop runs without one."""
    loop._ssock = loop._csock = None


asyncio.selector_events.BaseSelectorEventLoop._make_self_pipe = _no_self_pipe
asyncio.selector_events.BaseSelectorEventLoop._close_self_pipe = _no_self_pipe
asyncio.selector_events.BaseSelectorEventLoop._write_to_self = lambda loop: None

# WASI refuses sockets with errors that read like a broken network ("gaierror: Non-recoverable
# error"), and threads with "can't start new thread". Say what the sandbox lacks instead.
import _thread  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402

_NO_SOCKETS = ("the sandbox has no network sockets: for HTTP use urllib.request or "
               "host.http.request, which the host carries out under its HTTP policy")
_NO_THREADS = ("can't start new thread: the sandbox has no threads (CPython on "
               "WebAssembly); do the work in the calling thread")


def _no_sockets(*args, **kwargs):
    raise host.CapabilityDenied(_NO_SOCKETS)


def _no_threads(*args, **kwargs):
    raise RuntimeError(_NO_THREADS)  # the type CPython raises, so callers' handlers still work


socket.socket.__init__ = _no_sockets
for _name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr",
              "getnameinfo", "socketpair", "fromfd"):
    setattr(socket, _name, _no_sockets)
_thread.start_new_thread = _thread.start_new = _no_threads
if hasattr(_thread, "start_joinable_thread"):
    _thread.start_joinable_thread = _no_threads
threading._start_joinable_thread = threading._start_new_thread = _no_threads

# Files exist only under the host's mounts (see wasibox_files.py).
wasibox_files.install()

# The package set's modules, imported now so a run pays nothing to import them.
wasibox_packed.import_package_set()


# -- run time --------------------------------------------------------------------------------

# What the builtins are now, with this runner's patches, is what every job starts from.
wasibox_job.keep_builtins()
# Frames of these files stand in for what natively is C (os.urandom, open, os.stat, the
# import system), so tracebacks leave them out, as a native CPython's have no frame there.
wasibox_job.hide_files(__file__, wasibox_batch.__file__, wasibox_files.__file__,
                       wasibox_packed.__file__)


class WitWorld(wit_world.WitWorld):
    def execute(self, request: str) -> str:
        return _execute(request, _STREAMS)


# The seed the snapshot's ``random`` module was seeded with at build time (see the end of this
# file): a job with this seed skips re-seeding, which costs more than the rest of a small run.
_SNAPSHOT_SEED = 0
#: How a flat request with that seed starts (see ``_flat_run``).
_FLAT_SNAPSHOT_SEED = f"\x01{_SNAPSHOT_SEED}\x00"


def _execute(request, streams):
    """Run one job (see wasibox/_wire.py for its shape) and return the encoded reply.

    The request is trusted (the host built it). A plain run's is flat, and sliced (see
    ``_flat_run``); any other is marshalled: ``marshal.loads`` is C, where msgpack's
    pure-Python decoder cost more fuel than a small program does.
    """
    if request.startswith("\x01"):  # a plain run, flat
        # Only a one-shot run in a fresh, primed instance is sent flat (a session's call
        # carries "session", so it is a map): sys.stdout, sys.stderr and sys.argv are still
        # what the snapshot and the priming job left them, ``streams`` and [""] (see the
        # end of this file). Setting them again (and calling ``wasibox_job.prepare``) cost
        # ~0.02 ms of a paced run's call, whose code and data are out of the CPU's caches.
        code, compiled = _flat_run(request)
        return wasibox_job.run_code(code, compiled, streams, _program, _finish, _heap_top)
    if request.startswith("\x00"):  # a run, call or compile: marshal, one char per byte
        job = marshal.loads(request.encode("latin-1")[1:])
        records = ""
    else:  # a batch: its map in base64, then a NUL and its records
        request, _, records = request.partition("\x00")
        job = marshal.loads(binascii.a2b_base64(request))
    sys.stdout, sys.stderr = streams
    wasibox_job.prepare(job)
    # A session's random stream is seeded once, by its first call, and then runs on.
    seed = job.get("seed")
    if seed != _SNAPSHOT_SEED and not (job.get("session", False) and wasibox_job.SESSION):
        random.seed(seed)  # None reseeds from the entropy capability: seeded or real
    if job.get("op") == "batch":
        return wasibox_batch.execute_batch(job, records.encode("latin-1"), streams, _program)
    reply = wasibox_job.run_job(job, streams, _program, _finish, _heap_top)
    if "prime" in job:
        # The host's priming call, before the instance serves its run: its garbage (the
        # program's namespace, its function) is collected now, off the run's path, so the
        # run need not collect before its program and the program's gc.collect() finds
        # none of it. (Generation 1, as the run's own collection was: a full one would
        # also empty the free lists the run allocates from.)
        gc.collect(1)
        # The priming request is a map; a plain run's is flat, and its parsing, met first
        # in the run, faulted once per run on a page of its bytecode.
        _flat_run("\x010\x004\x00pass")
        # Then every free chunk (the priming job's, which it may have written only in
        # part) and 64 KiB of the heap's top are written, zeroed as the filling does at
        # build time (see _plug_heap_holes), and freed again: a run's chunks, of other
        # sizes than the priming job's, came from there and faulted once per run.
        _plug_heap_holes(_PRIMED_TOP_BYTES)
        # componentize-py reseeds ``random`` from entropy on an instance's first call (this
        # one): put back the snapshot's seed, which a run with that seed takes as it is, so
        # that it draws what random.Random(0) draws, as every other seed's run does.
        random.seed(_SNAPSHOT_SEED)
    return reply


def _flat_run(request):
    """A plain run's flat request, sliced: its code and compiled code (None if not sent),
    after ``random`` is seeded with its seed (unless that is the snapshot's)."""
    seed_end = request.index("\x00", 1)
    code_start = request.index("\x00", seed_end + 1) + 1
    code_end = code_start + int(request[seed_end + 1:code_start - 1])
    if not request.startswith(_FLAT_SNAPSHOT_SEED):  # no int() of the usual seed: ~2K fuel
        random.seed(int(request[1:seed_end]) if seed_end > 1 else None)
    return (request[code_start:code_end],
            request[code_end:].encode("latin-1") if code_end < _len(request) else None)


#: How much of the heap's top the priming job writes (see ``_execute``).
_PRIMED_TOP_BYTES = 64 * 1024


# What the program left open is flushed (closed, unless in a session) before the host
# publishes. Bound here, not wrapped: a wrapper's frame cost ~1K fuel per run.
_finish = wasibox_files.finish


def _program(code, compiled, filename):
    """The program's code object: loaded from ``compiled`` if the host sent it, else compiled.

    Then the host is told, before any of the program runs, so that it meters the program and
    not its compilation. After compiling, the collector runs first, so that the program
    starts with none of the garbage compiling made.
    """
    if compiled is None:
        program = compile(code, filename, "exec", dont_inherit=True)
        gc.collect()
    else:
        # Loading makes no garbage, and the priming job collected its own before it
        # returned (see ``_execute``): a young collection here would find nothing and
        # cost ~7K fuel (the generation-1 one it replaces cost ~11K).
        program = marshal.loads(compiled)
    _start()
    return program


# The warm-up swaps in a stand-in: there is no host at build time.
_start = _runner.start
wasibox_job.hide_from_warnings(WitWorld.execute, _execute)


def _heap_top():
    """Where a fresh block from the C allocator ends: a floor for the linear memory in use.

    A bytes object keeps its data inline, so its id (its address in linear memory) plus its
    size is the block's end. 512 bytes (plus the object's header) is past what CPython's
    small-object allocator serves, so the block comes from the C heap, as a 4 KiB one did;
    zeroing it costs ~1 fuel per byte, so the smaller block is ~3.5K fuel less per run.
    """
    try:
        block = _bytes(512)
        return _id(block) + _len(block)
    except _MemoryError:
        return 0


def _plug_heap_holes(probe=1 << 20):
    """Fill every free chunk of the C heap, so that a run allocates only from the top.

    This CPython has no small-object allocator of its own (WITH_PYMALLOC is off on WASI):
    every object is a chunk of the C allocator, and building leaves that heap's free chunks
    scattered over ~20 MiB of the snapshot. A run took its chunks from those free lists
    (and unlinking one writes to its neighbour in the list, elsewhere again), so a run
    wrote pages the priming job had not: ~2.5 page faults in every paced run, each a
    copy of a snapshot page or a write-protect fault after the slot's reset. Filled, a
    run's chunks come from the top of the heap or from chunks its own instance freed, and
    the priming job, which runs the same steps first, has already written those pages.
    The filling objects live for the life of the snapshot and no run touches them.

    The top of the heap starts where a ``probe``-sized block lands, as no free chunk is
    that large (should one be, it takes the probe, and the chunks above it stay free: a
    fault or two per run again, never a wrong result); taking it grows the memory ~0.6 MiB,
    which runs then allocate from without growing it. Each size of bytes object, from
    the probe's down by quarters, then by 4 bytes below 256, then the smallest object
    there is, is taken until one comes from the top: then no free chunk of that size or
    more is left. Returns the filling objects, in lists of 4,096 (one growing list would
    leave its old arrays free behind it).
    """
    block = _bytes(probe)
    top = _id(block)
    held = [[]]
    header = sys.getsizeof(b"")
    sizes = []
    size = probe
    while size > 256:
        sizes.append(size)
        size = size * 3 // 4
    sizes += range(256, header + 1, -4)
    for size in [*sizes, 0]:
        del block  # back to the top of the heap
        while True:
            # Size 0 stands for the smallest object there is: a bare object, 8 bytes.
            block = _bytes(size - header) if size else object()
            if _id(block) >= top:
                break
            if _len(held[-1]) == 4096:
                held.append([])
            held[-1].append(block)
    return held


# -- build time: warm-up and freeze -------------------------------------------------------------

def _warm_up():
    """Run typical jobs a few times now, so the snapshot holds the interpreter's specialised
    bytecode and warm caches: a fresh instance then writes (and copies) fewer pages."""
    threshold = gc.get_threshold()  # a batch raises it for its own instance (wasibox_batch)
    scratch = tuple(io.TextIOWrapper(io.BytesIO(), encoding="utf-8", line_buffering=buffering)
                    for buffering in (False, True))
    sys.stdout, sys.stderr = scratch  # what the flat runs print to (see _execute)

    jobs = [
        {"op": "run", "code": "print(1 + 1)", "seed": 0},
        {"op": "run", "code": "x = [i * i for i in range(100)]\nprint(sum(x))", "seed": 1},
        {"op": "run", "code": "raise ValueError('warm-up')", "seed": 0},
        {"op": "call", "code": "def f(a, b=1):\n    return {'v': [a, b, 'x', 1.5, None]}",
         "entry": "f", "args": [1], "kwargs": {"b": 2}, "seed": 0},
    ]
    global _start
    real_start, _start = _start, (lambda: None)
    for job in jobs[:]:
        jobs.append(dict(job, compiled=wasibox_job.compile_only(job["code"])))
        jobs.append({"op": "compile", "code": job["code"], "seed": 0})
    batches = [
        {"code": "def t(r):\n    return {'id': r['id'], 'total': r['price'] * r['qty']}",
         "entry": "t", "seed": 0,
         "records": [{"id": i, "price": 1.5, "qty": i} for i in range(64)] + [{}]},
        {"code": "def t(r):\n    return [r, str(r), b'x'] if r else (r, {1: r})",
         "entry": "t", "seed": 0, "records": list(range(8))},
    ]
    for batch in batches[:]:
        batches.append(dict(batch, compiled=wasibox_job.compile_only(batch["code"])))
    for _ in range(8):
        for job in jobs:
            if job["op"] == "run":  # the flat form a plain run is sent in (see _flat_run)
                _execute(f"\x01{job['seed']}\x00{len(job['code'])}\x00{job['code']}"
                         + job.get("compiled", b"").decode("latin-1"), scratch)
            _execute("\x00" + marshal.dumps(job, 4).decode("latin-1"), scratch)
        for batch in batches:
            fields = {key: value for key, value in batch.items() if key != "records"}
            request = binascii.b2a_base64(marshal.dumps(dict(fields, op="batch"), 4),
                                          newline=False).decode("ascii")
            records = marshal.dumps(batch["records"], 2).decode("latin-1")
            _execute(request + "\x00" + records, scratch)
    _start = real_start
    linecache.cache.pop(wasibox_job.SOURCE_NAME, None)
    wasibox_batch.HELD.clear()
    gc.unfreeze()  # the warm-up batches froze what they made; let the final collection see it
    # Runs start with CPython's own collection thresholds, not the warm-up batches' raised
    # one: with it, cyclic garbage (a program's, or its frames') lived 25 times longer.
    gc.set_threshold(*threshold)


# Every global the runner's code loads exists before the warm-up specialises that code: a
# key added later gives the module's dict new keys, whose version (which a specialised
# global load checks) the first run then writes, on a page the priming had only read.
_STREAMS = _HEAP_PLUGS = None
_warm_up()
# Every run starts from this state, so what every run would otherwise build first is built
# here, once: the output streams and the default seed's generator state.
_STREAMS = (_new_stream(1, line_buffering=False), _new_stream(2, line_buffering=True))
# What a flat run finds, and so need not set itself (see _execute); the argv of code run
# with -c or from stdin, as wasibox_job.prepare gives every other job.
sys.stdout, sys.stderr = _STREAMS
sys.argv = [""]
random.seed(_SNAPSHOT_SEED)
# Everything made so far lives for the life of the snapshot. Freezing it keeps the cyclic
# garbage collector from walking (and so page-faulting in) the whole snapshot heap during a
# run: a run's collections see only the objects that run made.
gc.collect()
gc.freeze()


_HEAP_PLUGS = _plug_heap_holes()
gc.freeze()

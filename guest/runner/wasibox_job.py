"""One job's run, as both guests run it: the wasm runner (``wasibox_guest.py``) and the
microVM agent (``guest/microvm/agent.py``, whose image packs this file beside it, as it packs
the ``host`` package).

The two differ in how a job arrives, where its output goes and what they set up first; they
do not differ in what running it means. This module holds that part once: the program's
``sys.argv``, ``sys.path``, ``os.environ`` and stdin from the job; running its code in a
fresh ``__main__`` namespace (or a session's), then calling its entry function; describing an
exception without the runner's frames; turning ``SystemExit`` into the exit status a Linux
parent would see; putting back the builtins the program may have replaced, where the reply
or a session's next call needs them; and writing the reply (its shape is in
``wasibox/_wire.py``).

Like the rest of the guest, this is not a security boundary: the program controls the whole
interpreter, this module included, and the host treats every reply as hostile.

This file never imports the host package: it is the other side of a trust boundary.
"""

import binascii
import builtins
import io
import json
import linecache
import marshal
import os
import sys
import traceback

import msgpack

__all__ = [
    "INTERNAL_FILE", "SESSION", "SOURCE_NAME", "compile_only", "describe", "encode_reply",
    "exit_status", "hide_files", "hide_from_warnings", "keep_builtins", "prepare",
    "restore_builtins", "run_code", "run_job",
]

#: The file name of the program's code, in tracebacks and in ``linecache``, unless the job
#: names another.
SOURCE_NAME = "<sandbox>"
#: The file name of the runner's frames that sit under the program while it runs (see
#: ``hide_from_warnings``): "importlib" and "_bootstrap" in it make the warnings machinery
#: pass over them, as it passes over the import system's own frames.
INTERNAL_FILE = "<wasibox runner, skipped like importlib._bootstrap>"
#: Frames of these files are left out of the tracebacks ``describe`` reports: the runner's,
#: and those that stand in for what natively is C (os.urandom, open, os.stat, ...), as a
#: native CPython's traceback has no frame there. ``hide_files`` adds to it.
_HIDDEN_FILES = {__file__, INTERNAL_FILE}
#: The builtins every job starts from (see ``keep_builtins``).
_PRISTINE = {}
#: The state of a session (``"session": True`` jobs): its namespace, once made. An ordinary
#: run's guest never sees a session job, so nothing of this outlives its run.
SESSION = {}


def hide_files(*filenames):
    """Leave frames of these files (the runner's own) out of what ``describe`` reports."""
    _HIDDEN_FILES.update(filenames)


def hide_from_warnings(*functions):
    """Give these functions' frames the runner's internal file name.

    A warning whose ``stacklevel`` reaches past the program (``warnings.warn(...,
    stacklevel=2)`` at its top level) is then reported as a native CPython reports it, at
    ``sys:1``, instead of at a line of the runner.
    """
    for function in functions:
        function.__code__ = function.__code__.replace(co_filename=INTERNAL_FILE)


def keep_builtins():
    """Remember the builtins as they are now (after the runner's own patches), for
    ``restore_builtins`` to put back after each job."""
    _PRISTINE.clear()
    _PRISTINE.update(vars(builtins))


def restore_builtins(namespace=vars(builtins), pristine=_PRISTINE):  # noqa: B008
    # Bound as defaults: clearing the namespace removes every builtin name until update runs.
    namespace.clear()
    namespace.update(pristine)


def _hide_frames(exc):
    """Unlink the frames of the hidden files from the tracebacks of ``exc`` and its chain."""
    pending, seen = [exc], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        kept = []
        tb = current.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename not in _HIDDEN_FILES:
                kept.append(tb)
            tb = tb.tb_next
        for frame, following in zip(kept, kept[1:] + [None], strict=True):
            frame.tb_next = following
        current.__traceback__ = kept[0] if kept else None
        pending += [current.__cause__, current.__context__]


def describe(exc):
    """The guest-visible description of an exception, without the runner's frames."""
    try:
        _hide_frames(exc)
    except BaseException:  # a hostile exception (a __traceback__ property, ...): as it is
        pass
    try:
        text = "".join(traceback.format_exception(exc))
    except BaseException:  # a hostile __str__ or __repr__ must not take the runner down
        text = f"{type(exc).__name__}: <exception could not be formatted>\n"
    try:
        message = str(exc)
    except BaseException:
        message = "<exception could not be formatted>"
    return {"type": type(exc).__name__, "message": message, "traceback": text}


def exit_status(code):
    """The exit status a Linux parent sees when CPython ends with ``SystemExit(code)``.

    None is 0. An int is converted to a C long long and truncated to int (-1 if it does not
    fit a long long), and the kernel keeps the low 8 bits. Anything else is printed to stderr
    and is 1.
    """
    if code is None:
        return 0
    if isinstance(code, int):
        code = int.__index__(code)  # its value, whatever an int subclass overrides
        return code & 0xFF if -2**63 <= code < 2**63 else 255
    try:
        print(code, file=sys.stderr)
        sys.stderr.flush()
    except BaseException:
        pass
    return 1


_json_string = json.encoder.encode_basestring_ascii  # C; escapes lone surrogates too
# The builtins ``run_job`` uses between the program's end and the restoring of the builtins
# (which a one-shot run's common reply skips): the program may have deleted or replaced them.
_BaseException, _MemoryError, _SystemExit, _callable = (
    BaseException, MemoryError, SystemExit, callable)


def encode_reply(exit_code, error, value, memory_error, heap_top):
    """The reply: a JSON object whose ``value``, if any, is base64 msgpack.

    Only the value needs msgpack's exact types. The rest has a fixed shape, so it is written
    directly with the C string escaper: msgpack's pure-Python encoder, or even ``json.dumps``
    (which builds a new encoder per call), cost more fuel than a small program does.
    Raises TypeError, ValueError or OverflowError for a value msgpack cannot carry.
    """
    # f-strings, not %-formatting, which cost ~2.4K more fuel per reply.
    if error is None and value is None and not memory_error:  # most replies: one string
        return f'{{"exit_code":{exit_code},"memory_error":false,"heap_top":{heap_top}}}'
    head = (f'{{"exit_code":{exit_code},"memory_error":'
            f'{"true" if memory_error else "false"},"heap_top":{heap_top}')
    parts = [head]
    if error is not None:
        parts.append(',"error":{"type":%s,"message":%s,"traceback":%s}' % (
            _json_string(error["type"]), _json_string(error["message"]),
            _json_string(error["traceback"])))
    if value is not None:
        parts.append(',"value":"%s"' % binascii.b2a_base64(
            msgpack.packb(value, use_bin_type=True), newline=False).decode("ascii"))
    parts.append("}")
    return "".join(parts)


def prepare(job):
    """Give the program what ``python -c`` or ``python script.py args`` would: ``sys.argv``
    and, if the job carries them (see wasibox/_wire.py), ``sys.path`` (the job's ``path``
    first), ``os.environ`` and ``sys.stdin``, all from the job alone."""
    sys.argv = [""]  # what CPython gives code run with -c or from stdin; argparse needs argv[0]
    if "argv" not in job:
        return
    sys.argv[:] = job["argv"]
    # Each of a session's calls sends the path again: put each directory first only once.
    sys.path[:0] = [entry for entry in job["path"] if entry not in sys.path]
    if job["env"]:
        os.environ.update(job["env"])
    stdin = job["stdin"]
    if stdin is not None:
        # As CPython's own stdin on POSIX: no newline translation, undecodable bytes kept.
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8",
                                     errors="surrogateescape", newline="\n")


def compile_only(code, filename=SOURCE_NAME):
    """The ``compile`` job: the marshalled code object, without running any of it.

    Version 2 has no back-references, so the bytes depend only on the source, not on the
    reference counts this interpreter's history left behind; 3.14's constant slices need
    version 5.
    """
    program = compile(code, filename, "exec", dont_inherit=True)
    try:
        return marshal.dumps(program, 2)
    except ValueError:
        return marshal.dumps(program)


def _compile(code, compiled, filename):
    return compile(code, filename, "exec", dont_inherit=True)


def _no_heap_top():
    return 0


def _nothing_to_finish(session):
    pass


def run_job(job, streams, load=_compile, finish=_nothing_to_finish, heap_top=_no_heap_top):
    """Run a ``run``, ``call`` or ``compile`` job and return the encoded reply.

    ``load(code, compiled, filename)`` gives the code object to run (compiled, or loaded
    from the ``compiled`` bytes the host sent). ``finish(session)`` runs after the program,
    before ``streams`` are flushed; what it raises fails a run that had not failed.
    ``heap_top()`` is the reply's floor for the memory in use (0 where the host measures
    it). Flushing ``streams`` and ``heap_top`` must not look up builtins: a one-shot run
    does not put back the ones its program deleted or replaced. Never raises for what the
    program does.
    """
    return run_code(job["code"], job.get("compiled"), streams, load, finish, heap_top,
                    job.get("op"), job.get("filename", SOURCE_NAME), job.get("session", False),
                    job)


def run_code(code, compiled, streams, load, finish, heap_top, op="run", filename=SOURCE_NAME,
             session=False, job=None):
    """``run_job`` on the job's fields, as ``run_job`` takes them from its map (``job``: the
    map, for a call's entry and arguments). With the defaults, a plain run, which the wasm
    runner's flat request gives without a map: building one and reading its fields back
    cost ~9K fuel and ~0.028 ms of a paced warm run's call (its code and data cold)."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    if session:
        # A session's calls share one namespace, made by its first call.
        namespace = SESSION.setdefault("namespace",
                                       {"__name__": "__main__", "__builtins__": builtins})
    else:
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        if filename != SOURCE_NAME:
            namespace["__file__"] = filename
    exit_code = 0
    error = None
    value = None
    memory_error = False
    try:
        if op == "compile":
            value = compile_only(code, filename)
        else:
            exec(load(code, compiled, filename), namespace)
        if op == "call":
            entry = job.get("entry")
            function = namespace.get(entry)
            if not _callable(function):
                raise NameError(f"the code defines no callable named {entry!r}")
            value = function(*job.get("args", ()), **job.get("kwargs", {}))
    except _SystemExit as exc:
        restore_builtins()  # from here on the runner's code runs, which needs them
        exit_code = exit_status(exc.code)
    except _MemoryError as exc:
        restore_builtins()
        memory_error = True
        error = describe(exc)
        exit_code = 1
    except _BaseException as exc:
        restore_builtins()
        error = describe(exc)
        exit_code = 1
    try:
        finish(session)
    except _BaseException as exc:
        if error is None and exit_code == 0:
            restore_builtins()
            error = describe(exc)
            exit_code = 1
    for stream in streams:
        try:
            stream.flush()
        except _BaseException:
            pass
    if error is None and value is None and not session:
        # The most common reply, of a one-shot instance: its fixed shape needs no builtins
        # (``heap_top`` and ``streams`` must not either), and nothing runs in this instance
        # after it, so whatever the program did to the builtins can stay (restoring them
        # was a sixth of a small run's fuel). Every other path restores them first.
        return encode_reply(exit_code, None, None, memory_error, heap_top())
    # The program may have replaced builtins the reply's encoder relies on, and a session's
    # next call starts from the pristine ones.
    restore_builtins()
    try:
        return encode_reply(exit_code, error, value, memory_error, heap_top())
    except (TypeError, ValueError, OverflowError) as exc:
        if error is None and exit_code == 0:
            problem = TypeError(f"the return value of {job.get('entry')!r} is not "
                                f"msgpack-compatible: {exc}")
            error = {"type": "TypeError", "message": str(problem), "traceback": ""}
            exit_code = 1
        return encode_reply(exit_code, error, None, memory_error, heap_top())


hide_from_warnings(run_job, run_code)

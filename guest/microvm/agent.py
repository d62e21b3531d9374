"""The microVM guest agent: the guest's PID 1 after the initramfs hands over.

It imports the scientific stack once, tells the host it is ready, and then waits for one job
on its virtio-serial port. The host snapshots the VM at that point (the template) and restores
a fresh copy-on-write copy of it for every run, so the imports below cost nothing per run and
no state carries from one run to the next.

A job runs in a forked child that drops every privilege: an unprivileged uid, no channel to
the host, a process cap (fork bombs), a CPU-time cap (the VM's meaning of fuel), and the OOM
killer's first pick. The agent relays the child's output, enforces the output cap, and reports
how the child ended. The host trusts none of it: it checks every frame, and enforces the
timeout, the output cap and the VM's memory itself.

Frames on the port: a 4-byte big-endian length, then one msgpack map. Guest to host::

    {"kind": "ready", "python": str}
    {"kind": "output", "fd": 1 | 2, "data": bytes}
    {"kind": "call", "name": str, "payload": bytes}   # a host function or HTTP call
    {"kind": "files", "mount": int, "entries": [...]}  # a writable mount, after the job
    {"kind": "done", "reply": str | None, "exit_code": int | None, "limit": str | None,
     "fault": None | {"type", "message", "traceback"}, "cpu_s": float,
     "memory_peak_bytes": int, "truncated": [fd, ...]}

``reply`` is the wasm runner's reply (JSON, shape in ``wasibox/_wire.py``), written by the
same job core, ``wasibox_job.py`` beside this file: the image packs the wasm runner's own copy,
so a job runs the same way on both backends, and the host builds the result with the same code.
Host to guest, once per VM::

    {"kind": "run", "job": <the wasm runner's request>, "output_bytes": int,
     "cpu_s": int, "entropy": bytes, "time_ns": int, "mounts": [<mount>, ...]}
    {"kind": "files", "mount": int, "entries": [...]}  # with mounts: their contents,
    {"kind": "files_end"}                              # then this, before the job starts
    {"kind": "result", "ok": bool, "payload": bytes}  # the answer to one "call"

Mounts: the agent builds them before the job and reports the writable ones after it
(``wasibox_vm_files.py`` beside this file says how, and what the entries are).

Host functions and HTTP: the child imports the wasm guest's own ``host`` module, whose
channel here is a pair of pipes to this agent; the agent relays each call to the host and
the answer back. The host checks every call exactly as it does for the wasm guest.

This file never imports the host package: it is the other side of a trust boundary.
"""

import fcntl
import gc
import io
import os
import random
import resource
import select
import signal
import struct
import sys
import threading
import time
import types

import msgpack

# isort: split
# Imported now, before the template snapshot, so a run never pays for them.
import asyncio  # noqa: F401
import collections  # noqa: F401
import csv  # noqa: F401
import dataclasses  # noqa: F401
import datetime  # noqa: F401
import decimal  # noqa: F401
import json
import math  # noqa: F401
import re  # noqa: F401
import statistics  # noqa: F401

try:
    import numpy  # noqa: F401
    import pandas  # noqa: F401
except ImportError as exc:  # an image without them still serves plain Python
    print(f"wasibox-agent: {exc}", flush=True)

PORT_NAME = "agent"
NOBODY = 65534
#: Processes the unprivileged user may have at once: enough for a small pool, not a bomb.
MAX_PROCESSES = 64
#: Largest frame accepted from the host (the job carries the code and its arguments).
MAX_REQUEST_BYTES = 96 * 2**20
#: Largest reply the child may send back (the host caps it again).
MAX_REPLY_BYTES = 88 * 2**20
OUTPUT_CHUNK = 1 << 16
RNDRESEEDCRNG = 0x5207
_AGENT_FILE = __file__

# The job core beside this file: the image packs the wasm runner's own wasibox_job.py here,
# so a job runs the same way on both backends. The ``host`` module comes from here too.
sys.path.insert(0, os.path.dirname(_AGENT_FILE))
import wasibox_job  # noqa: E402

wasibox_job.keep_builtins()
wasibox_job.hide_files(_AGENT_FILE)


# -- the channel -------------------------------------------------------------------------------

def _port_path():
    root = "/sys/class/virtio-ports"
    for _ in range(400):
        for entry in sorted(os.listdir(root)) if os.path.isdir(root) else ():
            try:
                with open(os.path.join(root, entry, "name")) as handle:
                    if handle.read().strip() == PORT_NAME:
                        return "/dev/" + entry
            except OSError:
                continue
        time.sleep(0.025)
    raise SystemExit("wasibox-agent: no virtio-serial port named 'agent'")


class Channel:
    def __init__(self, path):
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def send(self, message):
        data = msgpack.packb(message, use_bin_type=True)
        view = memoryview(struct.pack(">I", len(data)) + data)
        while view:
            try:
                written = os.write(self.fd, view)
            except InterruptedError:
                continue
            view = view[written:]

    def _read_exactly(self, size):
        chunks = []
        while size:
            try:
                data = os.read(self.fd, min(size, 1 << 20))
            except InterruptedError:
                continue
            if not data:
                # No host on the other end yet (a restored VM before the host connects).
                time.sleep(0.002)
                continue
            chunks.append(data)
            size -= len(data)
        return b"".join(chunks)

    def receive(self):
        (size,) = struct.unpack(">I", self._read_exactly(4))
        if size > MAX_REQUEST_BYTES:
            raise SystemExit("wasibox-agent: request frame too large")
        return msgpack.unpackb(self._read_exactly(size), raw=False, strict_map_key=False)


# -- the child: runs the job with nothing but its own pipes -----------------------------------

def execute(job):
    """Run one job (the wasm runner's request) and return the encoded reply."""
    seed = job.get("seed")
    numpy_module = sys.modules.get("numpy")
    if not (job.get("session", False) and wasibox_job.SESSION):
        random.seed(seed)  # None: from the kernel's entropy, which the agent reseeded
    else:  # a session's streams are seeded once, then run on
        numpy_module = None
    if numpy_module is not None:
        # numpy's global generator was seeded when the template imported it: every run would
        # otherwise draw the same stream. Seeded like ``random``; None draws fresh entropy.
        numpy_module.random.seed(None if seed is None else seed & 0xFFFFFFFF)
    if "argv" in job:
        # The job's environment replaces the child's defaults, so that a program sees the
        # same os.environ on both backends.
        os.environ.clear()
    wasibox_job.prepare(job)
    return wasibox_job.run_job(job, (sys.stdout, sys.stderr))


class _Err(Exception):
    """The component binding's ``Err``: the host refused a call (its payload says how)."""

    def __init__(self, value):
        super().__init__(value)
        self.value = value


#: The child's two pipes to this agent, set after the fork (see ``_child``).
_HOST_PIPES = {}
_host_lock = threading.Lock()


def _read_pipe_exactly(fd, size):
    chunks = []
    while size:
        data = os.read(fd, min(size, 1 << 20))
        if not data:
            raise OSError("the host channel closed")
        chunks.append(data)
        size -= len(data)
    return b"".join(chunks)


def _host_call(name, payload):
    """``wit_world.imports.host.call`` for the VM: one call through the agent to the host."""
    call_w, result_r = _HOST_PIPES["call_w"], _HOST_PIPES["result_r"]
    frame = msgpack.packb({"name": name, "payload": payload.encode("latin-1")},
                          use_bin_type=True)
    with _host_lock:
        view = memoryview(struct.pack(">I", len(frame)) + frame)
        while view:
            view = view[os.write(call_w, view):]
        (size,) = struct.unpack(">I", _read_pipe_exactly(result_r, 4))
        reply = msgpack.unpackb(_read_pipe_exactly(result_r, size), raw=False)
    answer = reply["payload"].decode("latin-1")
    if not reply["ok"]:
        raise _Err(answer)
    return answer


def _load_host_module():
    """Import the wasm guest's ``host`` module, unchanged, over this agent's channel.

    It talks to ``wit_world.imports.host.call`` and catches ``componentize_py_types.Err``;
    here those are ``_host_call`` and ``_Err``. Imported before the template snapshot, with
    the urllib handler installed, as the wasm runner does.
    """
    wit_world = types.ModuleType("wit_world")
    imports = types.ModuleType("wit_world.imports")
    channel = types.ModuleType("wit_world.imports.host")
    channel.call = _host_call
    wit_world.imports = imports
    imports.host = channel
    binding_types = types.ModuleType("componentize_py_types")
    binding_types.Err = _Err
    sys.modules.update({"wit_world": wit_world, "wit_world.imports": imports,
                        "wit_world.imports.host": channel,
                        "componentize_py_types": binding_types})
    try:
        import host
    except ImportError as exc:
        print(f"wasibox-agent: no host module: {exc}", flush=True)
        return
    host.http.install()


_load_host_module()

try:  # beside this file (the path _load_host_module added): mounts, copied in and out
    import wasibox_vm_files
except ImportError as exc:
    print(f"wasibox-agent: no mount support: {exc}", flush=True)
    wasibox_vm_files = None


def _data_limit(headroom=24 * 2**20):
    """A cap on the job's data segment: what it has now plus what the VM can still give.

    Past it the job gets MemoryError (reported as the memory limit), instead of driving the
    kernel into reclaim: with no swap and a read-only root, a VM near its end evicts the
    pages of the programs it runs and thrashes for minutes before the OOM killer acts.
    """
    try:
        with open("/proc/meminfo") as handle:
            available = next(int(line.split()[1]) * 1024 for line in handle
                             if line.startswith("MemAvailable:"))
        with open("/proc/self/status") as handle:
            used = next(int(line.split()[1]) * 1024 for line in handle
                        if line.startswith("VmData:"))
    except (OSError, StopIteration, ValueError):
        return None
    return max(used + available - headroom, used + headroom)


def _read_job(fd):
    """The next job of a session, from the agent (OSError once the agent closed the pipe)."""
    (size,) = struct.unpack(">I", _read_pipe_exactly(fd, 4))
    return msgpack.unpackb(_read_pipe_exactly(fd, size), raw=False, strict_map_key=False)


def _child(job, cpu_s, out_w, err_w, reply_w, call_w, result_r, mounts=None, job_r=None,
           _exit=os._exit):
    """In the forked child: drop privileges, run the job, write the reply, exit.

    With ``job_r`` (a session) each reply is framed by its length, and the child then waits
    there for the session's next job, in the same interpreter, until the agent closes it.
    Never returns, whatever the job did to this interpreter: ``_exit`` is bound early.
    """
    status = 70
    try:
        os.setsid()
        if mounts is not None:
            mounts.enter()  # the job's root, with its mounts in place
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("1000")
        resource.setrlimit(resource.RLIMIT_NPROC, (MAX_PROCESSES, MAX_PROCESSES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if job_r is None:  # a session's CPU time is metered per call, by the agent
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        data = _data_limit()
        if data is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (data, data))
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        keep = sorted({reply_w, call_w, result_r} | ({job_r} if job_r is not None else set()))
        low = 3
        for fd in keep:
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        os.chdir("/tmp")
        os.environ.clear()
        os.environ.update(HOME="/tmp", PATH="/usr/bin:/bin", LANG="C.UTF-8", TMPDIR="/tmp")
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", line_buffering=True)
        _HOST_PIPES.update(call_w=call_w, result_r=result_r)
        # The preloaded stack stays frozen: a collection walking it would cost a second
        # under emulation, and the child is thrown away after one job anyway.
        while job is not None:
            reply = execute(job).encode("ascii")
            if job_r is not None:
                reply = struct.pack(">I", len(reply)) + reply
            view = memoryview(reply)
            while view:
                view = view[os.write(reply_w, view):]
            job = _read_job(job_r) if job_r is not None else None
        status = 0
    finally:
        _exit(status)


# -- the agent: relays, caps, classifies --------------------------------------------------------

def _oom_kills():
    try:
        with open("/proc/vmstat") as handle:
            for line in handle:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reseed(entropy):
    """Every restored VM starts with the template's RNG state: mix in the host's entropy."""
    try:
        fd = os.open("/dev/urandom", os.O_WRONLY)
        try:
            os.write(fd, entropy)
            fcntl.ioctl(fd, RNDRESEEDCRNG)
        finally:
            os.close(fd)
    except OSError as exc:
        print(f"wasibox-agent: reseeding failed: {exc}", flush=True)


def _mount_fault(exc):
    return {"type": "OSError", "traceback": "",
            "message": f"the VM could not set up the run's mounts: {exc}"}


def _receive_mounts(channel, specs):
    """Build the job's mounts and fill them from the host's ``files`` frames, up to its
    ``files_end``. Returns (mounts, None), or (None, fault) after reading every frame."""
    mounts = fault = None
    try:
        if wasibox_vm_files is None:
            raise OSError("this image's agent has no mount support")
        mounts = wasibox_vm_files.Mounts(specs)
        mounts.build()
    except Exception as exc:
        fault = _mount_fault(exc)
    while True:
        frame = channel.receive()
        if frame.get("kind") == "files_end":
            break
        if fault is None:
            try:
                mounts.receive(frame)
            except Exception as exc:
                fault = _mount_fault(exc)
    if fault is None:
        try:
            mounts.seal()
        except Exception as exc:
            fault = _mount_fault(exc)
    return (None, fault) if fault is not None else (mounts, None)


def _collect(mounts, channel):
    """Report the writable mounts' state to the host; None, or the fault if that failed."""
    try:
        mounts.collect(channel.send)
    except Exception as exc:
        return {"type": "OSError", "traceback": "",
                "message": f"the VM could not read back the run's mounts: {exc}"}
    return None


def _succeeded(reply):
    """True if the child's reply says the job ended well (so its writes count)."""
    try:
        fields = json.loads(bytes(reply))
    except ValueError:
        return False
    return isinstance(fields, dict) and fields.get("exit_code") == 0 and "error" not in fields


def _cpu_seconds(pid):
    """CPU time the process ``pid`` has used so far (user and system), or 0.0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _peak_memory(pid):
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle
                        if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return 0


class _Live:
    """The child of a session between its calls: its process, the agent's pipe ends, and
    the session's mounts (None without mounts)."""

    def __init__(self, pid, pidfd, out_r, err_r, reply_r, call_r, result_w, job_w, mounts):
        self.pid, self.pidfd = pid, pidfd
        self.out_r, self.err_r, self.reply_r, self.call_r = out_r, err_r, reply_r, call_r
        self.result_w, self.job_w = result_w, job_w
        self.mounts = mounts


def serve(channel, request, live=None):
    """Run one job and report it with a ``done`` frame.

    A session's job (``"session": True``) runs in a child that outlives it: this returns
    that child (give it back with the session's next request), or None once the child is
    gone, as it always is after a job outside a session. A session's CPU budget is per call,
    metered here from the child's CPU time, since its rlimit counts the whole life.
    """
    job = request["job"]
    session = bool(job.get("session"))
    output_room = int(request["output_bytes"])
    cpu_s = max(int(request["cpu_s"]), 1)
    mounts = None
    if live is None:
        _reseed(bytes(request.get("entropy", b"")))
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, int(request["time_ns"]))
        except (OSError, KeyError, ValueError):
            pass
        if request.get("mounts"):
            mounts, fault = _receive_mounts(channel, request["mounts"])
            if fault is not None:
                channel.send({"kind": "done", "reply": None, "exit_code": None, "limit": None,
                              "fault": fault, "cpu_s": 0.0, "memory_peak_bytes": 0,
                              "truncated": []})
                return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        reply_r, reply_w = os.pipe()
        call_r, call_w = os.pipe()
        result_r, result_w = os.pipe()
        job_r, job_w = os.pipe() if session else (None, None)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            os.close(channel.fd)
            for fd in (out_r, err_r, reply_r, call_r, result_w, job_w):
                if fd is not None:
                    os.close(fd)
            _child(job, cpu_s, out_w, err_w, reply_w, call_w, result_r, mounts, job_r)
        for fd in (out_w, err_w, reply_w, call_w, result_r, job_r):
            if fd is not None:
                os.close(fd)
        live = _Live(pid, os.pidfd_open(pid), out_r, err_r, reply_r, call_r, result_w, job_w,
                     mounts)
    else:
        frame = msgpack.packb(job, use_bin_type=True)
        view = memoryview(struct.pack(">I", len(frame)) + frame)
        try:
            while view:
                view = view[os.write(live.job_w, view):]
        except OSError:
            pass  # the child is gone: the loop below reports how it ended
    pid, pidfd = live.pid, live.pidfd
    out_r, err_r, reply_r, call_r, result_w = (live.out_r, live.err_r, live.reply_r,
                                               live.call_r, live.result_w)
    oom_before = _oom_kills()
    cpu_before = _cpu_seconds(pid) if session else 0.0
    calls = bytearray()
    streams = {out_r: 1, err_r: 2}
    open_fds = {out_r, err_r, reply_r, call_r}
    reply = bytearray()
    limit = None
    fault = None
    killed_by_agent = False
    truncated = set()

    def relay(fd, data):
        nonlocal output_room, limit, killed_by_agent
        if fd == call_r:
            calls.extend(data)
            while len(calls) >= 4:
                (size,) = struct.unpack(">I", calls[:4])
                if size > MAX_REQUEST_BYTES:
                    raise OverflowError
                if len(calls) < 4 + size:
                    break
                request = msgpack.unpackb(bytes(calls[4:4 + size]), raw=False)
                del calls[:4 + size]
                # Output written before the call reaches the host before the call does.
                drain()
                # Relayed as is: the host checks the name, the payload and the limits.
                channel.send({"kind": "call", "name": request.get("name"),
                              "payload": request.get("payload")})
                answer = channel.receive()
                frame = msgpack.packb({"ok": bool(answer.get("ok")),
                                       "payload": answer.get("payload", b"")},
                                      use_bin_type=True)
                view = memoryview(struct.pack(">I", len(frame)) + frame)
                try:
                    while view:
                        view = view[os.write(result_w, view):]
                except OSError:
                    pass
            return
        if fd == reply_r:
            if len(reply) + len(data) > MAX_REPLY_BYTES + 4:
                raise OverflowError
            reply.extend(data)
            return
        keep = data[:output_room]
        output_room -= len(keep)
        if keep:
            channel.send({"kind": "output", "fd": streams[fd], "data": keep})
        if len(keep) < len(data) and limit is None:
            truncated.add(streams[fd])
            limit = "output"
            killed_by_agent = True
            os.killpg(pid, signal.SIGKILL)

    def drain():
        """Relay the output already written, without waiting for more."""
        while True:
            pending = [fd for fd in (out_r, err_r) if fd in open_fds]
            ready, _, _ = select.select(pending, [], [], 0)
            if not ready:
                return
            for stream in ready:
                data = os.read(stream, OUTPUT_CHUNK)
                if data:
                    relay(stream, data)
                else:
                    open_fds.discard(stream)

    def replied():
        """Whether a session's child has written this call's whole (framed) reply."""
        if len(reply) < 4:
            return False
        return len(reply) >= 4 + struct.unpack(">I", reply[:4])[0]

    child_running = True
    try:
        while open_fds and (child_running or open_fds):
            if session and child_running and replied():
                drain()  # the child flushed its output before it replied
                break
            watch = list(open_fds) + ([pidfd] if child_running else [])
            wait = (0.1 if session else None) if child_running else 0
            ready, _, _ = select.select(watch, [], [], wait)
            if session and child_running and limit is None \
                    and _cpu_seconds(pid) - cpu_before >= cpu_s:
                limit = "fuel"
                killed_by_agent = True
                os.killpg(pid, signal.SIGKILL)
            if not ready:
                if child_running:
                    continue
                break
            for fd in ready:
                if fd == pidfd:
                    child_running = False
                    # The job is over: nothing the child left behind may keep running.
                    os.kill(-1, signal.SIGKILL)
                    continue
                data = os.read(fd, OUTPUT_CHUNK)
                if not data:
                    open_fds.discard(fd)
                    continue
                relay(fd, data)
    except OverflowError:
        killed_by_agent = True
        os.kill(-1, signal.SIGKILL)
        fault = {"type": "ProtocolError", "traceback": "",
                 "message": "the guest's reply is larger than the host accepts"}
    if session and child_running and fault is None and limit is None:
        # The call is over and the child lives on, waiting for the session's next job. The
        # host's staging mirrors the session's writable mounts after every call, whatever
        # the call's own outcome, as a wasm session's staging holds its writes as they are
        # made; what of it is published is decided when the session ends.
        if live.mounts is not None:
            fault = _collect(live.mounts, channel)
        channel.send({"kind": "done", "reply": bytes(reply[4:]).decode("ascii", "replace"),
                      "exit_code": None, "limit": None, "fault": fault,
                      "cpu_s": _cpu_seconds(pid) - cpu_before,
                      "memory_peak_bytes": _peak_memory(pid), "truncated": []})
        return live
    _, status, usage = os.wait4(pid, 0)
    os.kill(-1, signal.SIGKILL)
    cpu_used = usage.ru_utime + usage.ru_stime - cpu_before
    if session:
        reply = reply[4:] if replied() else bytearray()
    exit_code = None
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if limit is None and _oom_kills() > oom_before:
            limit = "memory"
        elif limit is None and (signum == signal.SIGXCPU or cpu_used >= cpu_s):
            limit = "fuel"
        elif limit is None and not killed_by_agent:
            fault = {"type": "Signal", "traceback": "",
                     "message": f"the guest process was killed by {signal.Signals(signum).name}"}
    elif not reply and fault is None:
        exit_code = os.WEXITSTATUS(status)  # os._exit, or a failure before the job ran
    if mounts is not None and limit is None and fault is None and _succeeded(reply):
        # The job ended well: report its writable mounts (the host publishes them only if
        # it agrees). Nothing of the job runs any more, so nothing changes under the walk.
        fault = _collect(mounts, channel)
    channel.send({
        "kind": "done",
        "reply": reply.decode("ascii", "replace") if reply and limit is None else None,
        "exit_code": exit_code,
        "limit": limit,
        "fault": fault,
        "cpu_s": cpu_used,
        "memory_peak_bytes": usage.ru_maxrss * 1024,
        "truncated": sorted(truncated),
    })
    return None


def main():
    with open("/proc/self/oom_score_adj", "w") as handle:
        handle.write("-1000")
    channel = Channel(_port_path())
    gc.collect()
    gc.freeze()
    channel.send({"kind": "ready", "python": sys.version.split()[0]})
    # The template snapshot is taken here, while this waits for its one job.
    request = channel.receive()
    live = serve(channel, request) if request.get("kind") == "run" else None
    while live is not None:  # a session: its child serves each next call
        request = channel.receive()
        live = serve(channel, request, live) if request.get("kind") == "run" else None
    while True:  # the host stops the VM; PID 1 must not exit
        signal.pause()


wasibox_job.hide_from_warnings(main, serve, _child, execute)

if __name__ == "__main__":
    main()

"""The microVM backend: code that needs native extensions runs in a VM with its own kernel.

Each run gets a VM restored copy-on-write from a clean template snapshot, taken once after
the guest agent (``guest/microvm/agent.py``) imported numpy and pandas; the VM is killed when
the run ends, so no state carries over. The agent speaks the wasm runner's message shapes, so
``RunResult`` is built by the same host code for both backends.

The engine sits behind a small seam (``Engine``): ``QemuMicrovm`` drives QEMU's ``microvm``
machine, which is what Debian provides; a Firecracker driver would implement the same four
methods (its jailer, vsock and native snapshots map onto them).

Threat model, in layers:

* **The guest kernel.** Guest code runs as an unprivileged user in its own kernel; a kernel
  exploit gains the VM, not the host. The VM has *no network device at all* (never QEMU user
  networking, which exposes host loopback), a read-only root file system, RAM-backed /tmp
  inside its memory cap, and one virtio-serial port to the agent.
* **The accelerator.** With KVM, QEMU's device model is the boundary QEMU's security policy
  covers. Under TCG (software emulation, used where KVM cannot run the guest) QEMU's policy
  says it is *not* a security boundary, so wasibox refuses TCG unless the caller opts in
  (``Sandbox(allow_emulation=True)`` or ``WASIBOX_ALLOW_EMULATION=1``), and reports
  ``r.isolation`` (``"kvm"`` or ``"tcg"``) on every result.
* **Around QEMU.** QEMU runs with ``-sandbox on`` (seccomp: no spawning, no privilege
  changes), ``-nodefaults``, inside bubblewrap: new user, PID, network, IPC and UTS
  namespaces, all capabilities dropped, a fresh ``/dev`` and ``/tmp``, and of the host's files
  only the read-only system directories QEMU's binary needs, the image files (read-only) and
  the run's own directory with its sockets. The VM dies with its parent (``PR_SET_PDEATHSIG``
  on bubblewrap, ``--die-with-parent`` inside it), so no orphan VM outlives the host.
* **The host.** Everything from the guest is untrusted: frames are size-checked before they
  are decoded, the reply is checked by the shared wire code, the output cap and the timeout
  are enforced by the host whatever the agent says, and the console is kept in a bounded ring.

Capabilities: host functions and mediated HTTP travel over the VM's channel. The child runs
the wasm guest's own ``import host`` module (``guest/runner/host/``) over a pipe to the
agent, which relays each call as a frame; the host answers it with the same
``HostCalls``/``HttpGate`` code the wasm backend uses, so policy, limits and the capability
log are identical. Mounts are copied in over the channel (no host directory or disk reaches
the VM) and a writable mount's changes come back the same way, into the run's staging, which
the wasm backend's own code publishes only if the run ends ok (``backends/microvm/files.py``).

Residual risk: QEMU 7.2 cannot open the template's RAM file read-only and still map it
writable-private, so a QEMU compromised by a guest could write to the template file it was
restored from. The template is mapped private (``share=off``), so the guest itself cannot.

Limits: ``timeout_s`` kills the VM; ``memory_bytes`` is the VM's RAM (a guest OOM is reported
as ``"memory"``); ``output_bytes`` is enforced by the agent and again here; ``fuel`` has no
meaning in a VM, so it becomes a guest CPU-time budget of ``fuel / FUEL_PER_CPU_SECOND``
seconds (``RLIMIT_CPU``), reported as ``"fuel"`` when hit, and ``fuel_used`` is the CPU time
used at the same rate (not deterministic).

The folder: ``backend`` is the ``Backend`` (runs and sessions), ``runtime`` holds the image,
the accelerator and the templates and restores one VM per run, ``qemu`` is the engine seam and
its QEMU driver, ``channel`` the agent's framed channel and the console ring, ``files`` moves
mounts in and out, ``image`` builds the kernel and root file system, ``cli`` is ``wasibox
microvm``. The guest side is ``guest/microvm/``.
"""

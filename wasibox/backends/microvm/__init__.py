"""The microVM backend: QEMU microVMs for code that needs native extensions.

``backend`` is the ``Backend`` (and the runtime that boots VMs), ``files`` moves mounts in and
out of a VM, ``image`` builds the VM's kernel and root file system, ``cli`` is ``wasibox
microvm``. The guest side is ``guest/microvm/``.
"""

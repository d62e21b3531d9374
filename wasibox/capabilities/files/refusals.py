"""What a writable mount never publishes, named once for the host and the microVM.

``refusal`` says why an entry that is neither a regular file nor a directory is refused
(the reason ``RunResult.files_refused`` reports), and ``MAX_DEPTH`` is the deepest directory
nesting a writable mount may hold.

The host's staging uses this module, and so does the microVM's file agent
(``guest/microvm/wasibox_vm_files.py``): the image packs this very file into the VM as
``wasibox_refusals.py``. So it imports nothing but the standard library and nothing of
wasibox, and reads with the VM's own Python.
"""

import stat

__all__ = ["MAX_DEPTH", "refusal"]

#: Deepest directory nesting inside a writable mount. Staging and publishing walk a tree
#: holding descriptors per level, so a guest must not be able to build (and persist, in a
#: workspace) a tree deep enough to exhaust the host's descriptors or recursion limit.
#: Measured (bench/mount_depth.py): a run's file work at depth n holds at most 2n + 2
#: descriptors and n + 8 Python frames at once, so 130 and 72 at this cap, briefly, while
#: staging and publishing; 64 levels hold CPython's own 50-level tests below a directory.
MAX_DEPTH = 64


def refusal(mode: int) -> str:
    """Why an entry of this ``st_mode`` (not a regular file or directory) is not published."""
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISFIFO(mode):
        return "FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "not a regular file or directory"

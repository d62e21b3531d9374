"""The command-line form of a mount (``--mount HOST:GUEST[:rw[,c_access]]``,
``--scratch GUEST[:c_access]``): every text either reads as the Mount it says or is a
UsageError, and what ``format_mount`` writes reads back as the same mount."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wasibox import Mount, UsageError
from wasibox.capabilities.files.mount import format_mount, parse_mount, parse_scratch

#: A real host directory: a Mount checks that its host side exists.
HOST = Path(tempfile.mkdtemp(prefix="wasibox-mount-text-")).resolve()

options = st.lists(st.sampled_from(["ro", "rw", "c_access", "", "RW", "c-access", "x"])
                   | st.text(max_size=6), max_size=4)
guests = st.sampled_from(["/out", "/a/b", "/x,y", "out", "/", "/a/../b"]) | st.text(max_size=8)


@pytest.mark.parametrize("text, writable, c_access", [
    (f"{HOST}:/out", False, False),
    (f"{HOST}:/out:ro", False, False),
    (f"{HOST}:/out:rw", True, False),
    (f"{HOST}:/out:rw,c_access", True, True),
    (f"{HOST}:/out:c_access,rw", True, True),
])
def test_each_option_reads_as_the_mount_it_names(text: str, writable: bool,
                                                 c_access: bool) -> None:
    mount = parse_mount(text)
    assert (mount.host_path, mount.guest_path) == (HOST, "/out")
    assert (mount.writable, mount.c_access) == (writable, c_access)


@given(guest=guests, written=options)
def test_every_mount_text_is_its_mount_or_a_usage_error(guest: str, written: list[str]) -> None:
    text = f"{HOST}:{guest}" + (":" + ",".join(written) if written else "")
    try:
        mount = parse_mount(text)
    except UsageError as exc:
        assert str(exc)  # a message that says what to write instead
        return
    assert set(written) <= {"ro", "rw", "c_access"} and len(set(written)) == len(written)
    assert mount.writable == ("rw" in written) and mount.c_access == ("c_access" in written)
    assert not (mount.c_access and not mount.writable)
    assert parse_mount(format_mount(mount)) == mount


@given(guest=guests, writable=st.booleans(), c_access=st.booleans())
def test_format_mount_writes_what_parse_mount_reads_back(guest: str, writable: bool,
                                                         c_access: bool) -> None:
    try:
        mount = Mount(HOST, guest, writable=writable, c_access=c_access)
    except UsageError:
        return  # a guest path or an option combination that Mount itself refuses
    try:
        text = format_mount(mount)
    except UsageError:
        assert ":" in mount.guest_path  # the only mount the text form cannot hold
        return
    assert parse_mount(text) == mount


def test_c_access_on_a_read_only_mount_says_what_to_write() -> None:
    for text in (f"{HOST}:/out:c_access", f"{HOST}:/out:ro,c_access"):
        with pytest.raises(UsageError, match=f"write {HOST}:/out:rw,c_access"):
            parse_mount(text)


def test_scratch_takes_c_access_and_nothing_else() -> None:
    assert parse_scratch("/tmp") == Mount.scratch("/tmp")
    assert parse_scratch("/tmp:c_access") == Mount.scratch("/tmp", c_access=True)
    for text in ("/tmp:rw", "/tmp:c_access,rw", "/tmp:"):
        with pytest.raises(UsageError, match="--scratch takes GUEST or GUEST:c_access"):
            parse_scratch(text)
    with pytest.raises(UsageError, match="no --mount form"):
        format_mount(Mount.scratch("/tmp"))

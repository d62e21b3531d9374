"""Symbolic links, wherever they point, lead only where the mounts lead.

Hypothesis plants links with drawn targets (relative, absolute, climbing with ``..``,
naming the host's own path of a directory outside every mount, chained, looping) in two
mounts and a directory outside them, then looks up drawn paths. Each answer is compared
with a reference: a pure-Python model of Linux's path resolution over the guest's namespace
(the mount table above, the mounts' trees below), written without the host's code. The two
must agree on every answer (what the path names, or which error), and nothing a lookup
reaches may be outside the mounts. Once through ``FileSession`` (the host's logic, many
examples), once through a real guest (links made by the guest itself, fewer examples).
"""

from __future__ import annotations

import os
import stat
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import wasibox
from wasibox.capabilities.files.mount import Mount
from wasibox.capabilities.files.session import FilesError, FileSession

pytestmark = pytest.mark.guest

#: Each mount's tree (None: a directory); files hold their own path.
TREE = ("a", "a/b", "a/f", "f", "c")
FILES = ("a/f", "f")
MOUNTS = {"/data": "data", "/mnt/more": "more"}  # guest path -> host directory name
#: Where links are planted, as (mount's guest path, directory inside it).
LINK_DIRS = (("/data", ""), ("/data", "a"), ("/data", "a/b"), ("/mnt/more", ""),
             ("/mnt/more", "a"))
LINK_NAMES = ("l0", "l1", "l2")
#: Links one Linux lookup follows before ELOOP (fs/namei.c's MAXSYMLINKS).
LINUX_MAX_LINKS = 40
COMPONENTS = ("..", ".", "a", "b", "f", "c", "l0", "l1", "l2", "data", "mnt", "more",
              "nope", "outside", "secret")


class Missing(Exception):
    """The model's lookup ended at a name that does not exist."""


def model_lookup(root: dict[str, Any], path: str, follow: bool) -> Any:
    """What ``path`` names in the model namespace ``root``: a node (a dict for a directory,
    ("file", path) or ("link", target)), or raises FilesError / Missing. Linux's rules:
    ``..`` is the parent of what was reached, a link restarts from its directory or (if
    absolute) the root, at most LINUX_MAX_LINKS links per lookup, a trailing ``/`` follows and
    demands a directory."""
    budget = [LINUX_MAX_LINKS]

    def resolve(stack: list[Any], text: str, follow_last: bool) -> list[Any]:
        stack = [root] if text.startswith("/") else list(stack)
        names = [name for name in text.split("/") if name]
        trailing = text.endswith("/") or (names and names[-1] in (".", ".."))
        for index, name in enumerate(names):
            last = all(rest == "." for rest in names[index + 1:])
            here = stack[-1]
            if not isinstance(here, dict):
                raise FilesError("notdir")
            if name == ".":
                continue
            if name == "..":
                if len(stack) > 1:
                    stack.pop()
                continue
            if name not in here:
                raise Missing() if last else FilesError("noent")
            node = here[name]
            if isinstance(node, tuple) and node[0] == "link" and (
                    not last or follow_last or trailing):
                budget[0] -= 1
                if budget[0] < 0:
                    raise FilesError("loop")
                try:
                    stack = resolve(stack, node[1], True)
                except Missing:
                    if last:
                        raise
                    raise FilesError("noent") from None
                continue
            stack.append(node)
        if (trailing or text.endswith("/")) and not isinstance(stack[-1], dict):
            raise FilesError("notdir")
        return stack

    return resolve([root], path, follow)[-1]


def build(base: Path, links: list[tuple[int, int, str]]) -> tuple[dict[str, Any],
                                                                   dict[int, str]]:
    """Make the mounts' host directories, an outside one, and the links; the model of the
    guest's namespace, and every inode of a file or directory -> its label."""
    inodes: dict[int, str] = {}
    root: dict[str, Any] = {}
    outside = base / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    inodes[outside.stat().st_ino] = "OUTSIDE"
    inodes[(outside / "secret").stat().st_ino] = "OUTSIDE"
    for guest, name in MOUNTS.items():
        host = base / name
        host.mkdir()
        node: dict[str, Any] = {}
        here = root
        for part in guest.strip("/").split("/")[:-1]:
            here = here.setdefault(part, {})
        here[guest.rsplit("/", 1)[1]] = node
        inodes[host.stat().st_ino] = guest
        for item in TREE:
            path = host / item
            parent = node
            for part in item.split("/")[:-1]:
                parent = parent[part]
            if item in FILES:
                path.write_text(f"{guest}/{item}")
                parent[path.name] = ("file", f"{guest}/{item}")
            else:
                path.mkdir()
                parent[path.name] = {}
            inodes[path.stat().st_ino] = f"{guest}/{item}"
    for where, which, target in links:
        guest, directory = LINK_DIRS[where]
        host = base / MOUNTS[guest] / directory / LINK_NAMES[which]
        if os.path.lexists(host):
            continue
        os.symlink(target.replace("HOST", str(outside)), host)
        parent = root
        for part in [*guest.strip("/").split("/"), *filter(None, directory.split("/"))]:
            parent = parent[part]
        parent[host.name] = ("link", target.replace("HOST", str(outside)))
    return root, inodes


targets = st.builds(
    lambda start, parts, end: start + "/".join(parts) + end,
    st.sampled_from(["", "/", "/data/", "/mnt/", "HOST/", "../", "../../"]),
    st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=5),
    st.sampled_from(["", "/"]))
plants = st.lists(st.tuples(st.integers(0, len(LINK_DIRS) - 1),
                            st.integers(0, len(LINK_NAMES) - 1), targets),
                  min_size=1, max_size=8)
queries = st.lists(st.builds(
    lambda start, parts, end: start + "/".join(parts) + end,
    st.sampled_from(["/data/", "/mnt/more/", "/data/a/", "/", "/mnt/"]),
    st.lists(st.sampled_from(COMPONENTS), max_size=5),
    st.sampled_from(["", "/", "/."])), min_size=1, max_size=6)


def expected(root: dict[str, Any], path: str, follow: bool) -> tuple[str, str]:
    try:
        node = model_lookup(root, path, follow)
    except Missing:
        return ("error", "noent")
    except FilesError as exc:
        return ("error", exc.code)
    if isinstance(node, dict):
        return ("directory", "")
    if node[0] == "link":
        return ("symlink", node[1])
    return ("regular", node[1])


def observed(session: FileSession, path: str, follow: bool) -> tuple[str, str]:
    """The session's answer, in the model's terms; asserts that it is inside a mount."""
    try:
        info = session.stat(path, follow)
    except FilesError as exc:
        return ("error", exc.code)
    if info.kind == "symlink":
        return ("symlink", session.readlink(path))
    if info.kind == "regular":
        fd = session.open(path, 1, 0)
        try:
            return ("regular", session.read(fd, 100))
        finally:
            session.close_fd(fd)
    return (info.kind, "")


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(links=plants, paths=queries, follow=st.booleans())
def test_lookups_agree_with_the_model_and_stay_inside(tmp_path_factory: pytest.TempPathFactory,
                                                      links: list[tuple[int, int, str]],
                                                      paths: list[str], follow: bool) -> None:
    base = tmp_path_factory.mktemp("links")
    root, inodes = build(base, links)
    mounts = [Mount(base / name, guest) for guest, name in MOUNTS.items()]
    with FileSession(mounts, open_files=16) as session:
        for path in paths:
            assert observed(session, path, follow) == expected(root, path, follow), path
            try:
                info = session.stat(path, follow)
            except FilesError:
                continue
            assert inodes.get(info.ino) != "OUTSIDE", path
    assert (base / "outside" / "secret").read_text() == "secret"


GUEST_LOOKUP = textwrap.dedent("""
    import os, stat
    def main(links, paths):
        for directory, name, target in links:
            try:
                os.symlink(target, f"{directory}/{name}")
            except FileExistsError:
                pass
        answers = []
        for path in paths:
            try:
                mode = os.stat(path).st_mode
            except OSError as exc:
                answers.append(["error", errorcode[exc.errno]])
                continue
            if stat.S_ISDIR(mode):
                answers.append(["directory", ""])
            else:
                with open(path) as f:
                    answers.append(["regular", f.read()])
        return answers
""")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(links=plants, paths=queries)
def test_a_guests_own_links_agree_with_the_model(tmp_path_factory: pytest.TempPathFactory,
                                                 links: list[tuple[int, int, str]],
                                                 paths: list[str]) -> None:
    base = tmp_path_factory.mktemp("guest-links")
    root, _ = build(base, [])
    # The guest plants the links in the writable mount; the model plants the same ones.
    made = []
    for where, which, target in links:
        guest, directory = LINK_DIRS[where]
        target = target.replace("HOST", str(base / "outside"))
        parent = root
        for part in [*guest.strip("/").split("/"), *filter(None, directory.split("/"))]:
            parent = parent[part]
        parent.setdefault(LINK_NAMES[which], ("link", target))
        made.append(["/".join(filter(None, (guest, directory))), LINK_NAMES[which], target])
    mounts = [wasibox.Mount(base / name, guest, writable=True) for guest, name in MOUNTS.items()]
    with wasibox.Sandbox(mounts=mounts) as sb:
        r = sb.run("from errno import errorcode\n" + GUEST_LOOKUP, entry="main",
                   args=(made, paths))
    assert r.ok, (r.error, r.stderr)
    want = []
    for path in paths:
        kind, value = expected(root, path, True)
        want.append(["error", "E" + value.upper()] if kind == "error" else [kind, value])
    assert r.value == want
    assert (base / "outside" / "secret").read_text() == "secret"
    for name in MOUNTS.values():  # links are never published
        assert not any(p.is_symlink() for p in (base / name).rglob("*")
                       if ".wasibox-staging" not in p.parts)
    assert stat.S_ISDIR(os.lstat(base / "outside").st_mode)


def test_dotdot_climbs_through_deep_directories_and_links(tmp_path: Path) -> None:
    # Deeper than the descriptors a lookup keeps, so ".." must walk again from the root.
    data = tmp_path / "data"
    deep = data.joinpath(*[f"d{i}" for i in range(40)])
    deep.mkdir(parents=True)
    for level in (0, 5, 39):
        data.joinpath(*[f"d{i}" for i in range(level)], "f").write_text(f"level {level}")
    os.symlink("../" * 35 + "f", deep / "up")  # from 40 levels down to 5
    os.symlink("/data/" + "/".join(f"d{i}" for i in range(39)) + "/f", data / "down")
    below = "/data/" + "/".join(f"d{i}" for i in range(40))
    with FileSession([Mount(data, "/data")], open_files=4) as session:
        answers = []
        for path in (below + "/up", below + "/" + "../" * 40 + "f", "/data/down",
                     below + "/" + "../" * 41 + "data/f", below + "/" + "../" * 42):
            try:
                fd = session.open(path, 1, 0)
            except FilesError as exc:
                answers.append(exc.code)
                continue
            try:
                answers.append(session.read(fd, 100) if session.fstat(fd).kind == "regular"
                               else "directory")
            finally:
                session.close_fd(fd)
    assert answers == ["level 5", "level 0", "level 39", "level 0", "acces"]
    assert not any(os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path))
                   for fd in os.listdir("/proc/self/fd")
                   if os.path.islink(f"/proc/self/fd/{fd}"))

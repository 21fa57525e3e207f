"""Crash-state enumeration for the publication protocol (ALICE-style weak filesystem model).

``RecordingOps`` is injected into ``LocalStore``: every mutating call still runs
for real, and is also appended to a trace of persistence operations on
*inodes* (so a write through a file descriptor stays attached to its file even
after the staging directory is renamed):

- ``Link(dir, name, inode)`` / ``Unlink(dir, name)``: directory-entry changes
  (create, mkdir; a rename is an unlink plus a link, which may persist
  separately: "rename may appear as unlink-then-link");
- ``Write(inode, offset, data)``: file data;
- ``Sync(inode)``: a completed fsync of a file or directory.

The model of what a crash may leave (``crash_state``): every operation issued
before the crash point is either persisted or lost, except that a ``Sync`` that
completed forces every earlier operation on its inode (data for a file, entries
for a directory) to have persisted. A lost write may instead leave zeros or a
prefix of its data. ``explore`` yields every prefix, every prefix with one
operation dropped (or zero-filled, or half-written), and a seeded random sample
of further subsets; each distinct state is materialised as a real directory.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainstate.storage.local import PosixOps


@dataclass(frozen=True)
class Link:
    dir: int
    name: str
    inode: int


@dataclass(frozen=True)
class Unlink:
    dir: int
    name: str


@dataclass(frozen=True)
class Write:
    inode: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class Sync:
    inode: int
    label: str  # for reports: what was fsynced


Op = Link | Unlink | Write | Sync


def target(op: Op) -> int:
    return op.dir if isinstance(op, (Link, Unlink)) else op.inode


@dataclass
class Tree:
    """Inodes: directories map names to inodes, files hold bytes. Inode 0 is the run directory."""

    dirs: dict[int, dict[str, int]]
    files: dict[int, bytearray]

    def copy(self) -> Tree:
        return Tree({k: dict(v) for k, v in self.dirs.items()}, {k: bytearray(v) for k, v in self.files.items()})

    def apply(self, op: Op, variant: str = "full") -> None:
        if isinstance(op, Link):
            self.dirs.setdefault(op.dir, {})[op.name] = op.inode
        elif isinstance(op, Unlink):
            self.dirs.get(op.dir, {}).pop(op.name, None)
        elif isinstance(op, Write):
            data = written(op.data, variant)
            buf = self.files.setdefault(op.inode, bytearray())
            if len(buf) < op.offset:
                buf.extend(bytes(op.offset - len(buf)))
            buf[op.offset:op.offset + len(data)] = data

    def reachable(self, inode: int = 0, prefix: str = "") -> Iterator[tuple[str, int]]:
        for name, child in sorted(self.dirs.get(inode, {}).items()):
            path = f"{prefix}{name}"
            yield path, child
            if child in self.dirs:
                yield from self.reachable(child, path + "/")

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for path, inode in self.reachable():
            h.update(path.encode() + b"\0")
            h.update(bytes(self.files[inode]) if inode in self.files else b"<dir>")
            h.update(b"\1")
        return h.hexdigest()

    def materialise(self, root: Path) -> None:
        root.mkdir(parents=True)
        for path, inode in self.reachable():
            if inode in self.dirs:
                (root / path).mkdir()
            else:
                (root / path).write_bytes(bytes(self.files.get(inode, b"")))


PAGE = 4096


def written(data: bytes, variant: str) -> bytes:
    """What an unsynced write may leave: all of it, zeros, a prefix, or a random set of its pages."""
    if variant == "full":
        return data
    if variant == "zeros":
        return bytes(len(data))
    if variant == "half":
        return data[: len(data) // 2]
    if variant.startswith("pages:"):  # each page independently persisted or zero (LazyFS-style)
        rng = random.Random(variant)
        pages = [data[i:i + PAGE] if rng.random() < 0.5 else bytes(len(data[i:i + PAGE]))
                 for i in range(0, len(data), PAGE)]
        return b"".join(pages)
    raise ValueError(variant)


def snapshot(root: Path) -> tuple[Tree, dict[str, int]]:
    """The durable starting state (a directory that was synced before the save began)."""
    tree = Tree({0: {}}, {})
    paths = {"": 0}
    counter = 0
    for path in sorted(root.rglob("*")):
        counter += 1
        rel = path.relative_to(root).as_posix()
        parent = paths[rel.rpartition("/")[0]]
        tree.dirs[parent][path.name] = counter
        paths[rel] = counter
        if path.is_dir():
            tree.dirs[counter] = {}
        else:
            tree.files[counter] = bytearray(path.read_bytes())
    return tree, paths


class RecordingOps(PosixOps):
    """Runs every call for real and records it as persistence operations on inodes."""

    def __init__(self, root: Path, noop_sync: int | None = None):
        self.root = root
        self.initial, self._paths = snapshot(root)
        self._next_inode = max(self._paths.values()) + 1
        self._dirs = {i for i in self.initial.dirs}
        self._fds: dict[int, tuple[int, str]] = {}
        self._offsets: dict[int, int] = {}
        self.trace: list[Op] = []
        self.groups: list[tuple[int, ...]] = []  # the entry operations of one rename
        self.syncs_seen = 0
        self.noop_sync = noop_sync  # mutation: the n-th fsync does nothing and is not recorded
        self.returned_at: int | None = None

    # path <-> inode bookkeeping mirrors the real directory as calls happen
    def _rel(self, path: Path) -> str:
        return Path(path).relative_to(self.root).as_posix() if Path(path) != self.root else ""

    def _split(self, path: Path) -> tuple[int, str]:
        parent, _, name = self._rel(path).rpartition("/")
        return self._paths[parent], name

    def _new(self, path: Path, is_dir: bool) -> int:
        inode = self._next_inode
        self._next_inode += 1
        parent, name = self._split(path)
        self._paths[self._rel(path)] = inode
        if is_dir:
            self._dirs.add(inode)
        self.trace.append(Link(parent, name, inode))
        return inode

    def _move(self, src: Path, dst: Path) -> None:
        s_rel, d_rel = self._rel(src), self._rel(dst)
        inode = self._paths[s_rel]
        dst_parent, dst_name = self._split(dst)
        src_parent, src_name = self._split(src)
        start = len(self.trace)
        if d_rel in self._paths:
            self.trace.append(Unlink(dst_parent, dst_name))
        self.trace.append(Link(dst_parent, dst_name, inode))
        self.trace.append(Unlink(src_parent, src_name))
        self.groups.append(tuple(range(start, len(self.trace))))
        for key in [k for k in self._paths if k == s_rel or k.startswith(s_rel + "/")]:
            self._paths[d_rel + key[len(s_rel):]] = self._paths.pop(key)

    def _drop(self, path: Path) -> None:
        rel = self._rel(path)
        parent, name = self._split(path)
        self.trace.append(Unlink(parent, name))
        for key in [k for k in self._paths if k == rel or k.startswith(rel + "/")]:
            del self._paths[key]

    def _sync(self, inode: int, label: str) -> bool:
        self.syncs_seen += 1
        if self.syncs_seen == self.noop_sync:
            return False
        self.trace.append(Sync(inode, label))
        return True

    # the PosixOps interface
    def mkdir(self, path):
        super().mkdir(path)
        self._new(path, True)

    def create(self, path):
        fd = super().create(path)
        self._fds[fd] = (self._new(path, False), Path(path).name)
        self._offsets[fd] = 0
        return fd

    def write(self, fd, data):
        n = super().write(fd, data)
        self.trace.append(Write(self._fds[fd][0], self._offsets[fd], bytes(data[:n])))
        self._offsets[fd] += n
        return n

    def fsync(self, fd):
        inode, name = self._fds[fd]
        if self._sync(inode, name):
            super().fsync(fd)

    def close(self, fd):
        super().close(fd)
        del self._fds[fd]

    def fsync_dir(self, path):
        if self._sync(self._paths[self._rel(path)], self._rel(path) or "<run dir>"):
            super().fsync_dir(path)

    def rename(self, src, dst):
        super().rename(src, dst)
        self._move(src, dst)

    def replace(self, src, dst):
        super().replace(src, dst)
        self._move(src, dst)

    def link(self, src, dst):
        super().link(src, dst)
        inode = self._paths[self._rel(src)]
        parent, name = self._split(dst)
        self._paths[self._rel(dst)] = inode
        self.trace.append(Link(parent, name, inode))  # a second name for the same inode: its data is not written

    def unlink(self, path):
        super().unlink(path)
        self._drop(path)

    def rmtree(self, path):
        # Record what rmtree really does: unlink every entry, deepest first, then the directory.
        rel = self._rel(path)
        inner = sorted((k for k in self._paths if k.startswith(rel + "/")), key=lambda k: -k.count("/"))
        super().rmtree(path)
        for key in inner:
            parent, _, name = key.rpartition("/")
            self.trace.append(Unlink(self._paths[parent], name))
        self._drop(path)


def required(trace: list[Op], crash: int) -> set[int]:
    """Indices that must have persisted if the crash came after ``crash`` operations were issued."""
    must: set[int] = set()
    for j in range(crash):
        op = trace[j]
        if isinstance(op, Sync):
            must.update(k for k in range(j) if not isinstance(trace[k], Sync) and target(trace[k]) == op.inode)
    return must


def crash_state(initial: Tree, trace: list[Op], crash: int, keep: dict[int, str]) -> Tree:
    """Apply the first ``crash`` operations: required ones fully, others as ``keep`` says (absent: lost)."""
    must = required(trace, crash)
    tree = initial.copy()
    for i in range(crash):
        op = trace[i]
        if isinstance(op, Sync):
            continue
        variant = "full" if i in must else keep.get(i)
        if variant is not None:
            tree.apply(op, variant)
    return tree


@dataclass(frozen=True)
class Case:
    crash: int
    keep: tuple[tuple[int, str], ...]
    how: str


def explore(trace: list[Op], samples: int, seed: int, groups: list[tuple[int, ...]] = ()) -> Iterator[Case]:
    """Every prefix; every prefix minus one optional op or one whole rename (or with a write
    zeroed or half-written); then a seeded sample of random subsets."""
    n = len(trace)
    for crash in range(n, -1, -1):  # latest crash points first: that is where a missing barrier shows
        everything = {i: "full" for i in range(crash)}
        yield Case(crash, tuple(everything.items()), "prefix")
        must = required(trace, crash)
        optional = [i for i in range(crash) if i not in must and not isinstance(trace[i], Sync)]
        for group in groups:
            if all(i in optional for i in group):
                yield Case(crash, tuple((k, v) for k, v in everything.items() if k not in group),
                           f"prefix-{crash} minus rename {group}")
        for i in optional:
            yield Case(crash, tuple((k, v) for k, v in everything.items() if k != i), f"prefix-{crash} minus op {i}")
            if isinstance(trace[i], Write):
                for variant in ("zeros", "half"):
                    yield Case(crash, tuple({**everything, i: variant}.items()), f"prefix-{crash} op {i} {variant}")
    rng = random.Random(seed)
    windows = {c: [i for i in range(c) if i not in required(trace, c) and not isinstance(trace[i], Sync)]
               for c in range(n + 1)}
    windows = {c: ops for c, ops in windows.items() if ops}  # crash points where something may be lost
    for _ in range(samples if windows else 0):
        crash = rng.choice(sorted(windows))
        p = rng.random()
        keep = {i: "full" for i in range(crash)}
        for i in windows[crash]:
            if rng.random() >= p:
                del keep[i]
            elif isinstance(trace[i], Write):
                keep[i] = rng.choice(("full", "zeros", "half", f"pages:{rng.getrandbits(32)}"))
        yield Case(crash, tuple(keep.items()), f"random (seed {seed})")


def swapped(trace: list[Op], i: int) -> list[Op]:
    """Mutation: the program issued operations ``i`` and ``i + 1`` in the other order."""
    out = list(trace)
    out[i], out[i + 1] = out[i + 1], out[i]
    return out

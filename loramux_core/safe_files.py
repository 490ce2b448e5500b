"""Reading adapter files so that no read can leave the adapter roots.

Every adapter directory is reached from a directory handle opened once per root, one path
component at a time, each opened relative to its parent's handle with O_NOFOLLOW: a
symbolic link anywhere below the root, a `..`, a FIFO or a device in place of a file is
refused before a byte is read. A file is read whole and once into memory and hashed as it
is read; what the caller parses is exactly what was hashed, so the hash names the bytes in
use (`AdapterFiles.version`). A file whose size or modification time moves during the read
is refused instead of being half-read.

Each chunk of a file is handed to the hashing threads as soon as it is read
(loramux_core/file_digest.py), so the caller parses and converts the bytes while the
last chunks still hash (`FileRead.digest` waits for them).

Messages name paths only as the caller gave them (relative to the adapter directory or the
root), never what lies beyond a link, so a refusal reveals nothing outside the roots.

    roots = AdapterRoots(["/srv/adapters"])
    with roots.open_dir("tenant-a/v3") as d:      # PathRefused: outside, link, not a dir
        cfg = d.read("adapter_config.json", max_bytes=1 << 20)
    cfg.data, cfg.digest
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import PurePosixPath

from loramux_core.file_digest import CHUNK, HASH_THREADS, FileRead, chunk_hash, chunk_spans

from loramux_core.errors import AdapterChangedError, AdapterError, AdapterPathError as PathRefused


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# `alloc(nbytes)`: a writable buffer of at least nbytes to read a file into
Alloc = Callable[[int], memoryview]


class AdapterDir:
    """An open adapter directory: files in it are read by name, never through a link.
    Close it (or use it as a context manager) when done."""

    def __init__(self, fd: int, shown: str):
        self._fd = fd
        self.shown = shown  # the path as the caller named it, for messages

    def __enter__(self) -> "AdapterDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def names(self) -> list[str]:
        """The entries of the directory (no link is followed)."""
        try:
            return sorted(os.listdir(self._fd))
        except OSError as e:
            raise AdapterError(f"the directory cannot be listed ({os.strerror(e.errno)})",
                               feature="adapter_dir", file=self.shown) from None

    def kind(self, name: str) -> str | None:
        """'file', 'dir', 'link', 'other' for the entry `name`, or None if it is absent."""
        _check_name(name)
        try:
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise AdapterError(f"{name} cannot be examined ({os.strerror(e.errno)})",
                               feature="not_a_file", file=f"{self.shown}/{name}") from None
        return _kind(st.st_mode)

    def read(self, name: str, max_bytes: int, alloc: Alloc | None = None) -> FileRead:
        """All bytes of the regular file `name` in this directory, read once (into a
        buffer from `alloc` when given), and their digest. AdapterError when it is absent,
        not a regular file, larger than `max_bytes`, or changed while being read."""
        fd, st, where = self._open(name, max_bytes)
        try:
            return _read_whole(fd, st, name, where, alloc)
        except OSError as e:  # e.g. EIO, or a directory swapped in (EISDIR)
            raise AdapterError(f"{name} cannot be read ({os.strerror(e.errno)})",
                               feature="not_a_file", file=where) from None
        finally:
            os.close(fd)

    def read_head(self, name: str, max_bytes: int, max_head: int) -> tuple[bytes, int]:
        """The first bytes of the regular file `name` (as `read` checks it) up to the end
        of its safetensors header (8-byte length + that many bytes, at most `max_head`;
        only the 8 bytes when the length is larger), and the file's size. Nothing is
        hashed: for checks that do not name a version."""
        head, st = self.read_head_stat(name, max_bytes, max_head)
        return head, st.st_size

    def read_head_stat(self, name: str, max_bytes: int, max_head: int
                       ) -> tuple[bytes, os.stat_result]:
        """read_head, with the file's stat instead of its size."""
        fd, st, where = self._open(name, max_bytes)
        try:
            head = os.pread(fd, 8, 0)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            if 0 < n <= min(max_head, st.st_size - 8):
                head += os.pread(fd, n, 8)
            return head, os.fstat(fd)
        except OSError as e:
            raise AdapterError(f"{name} cannot be read ({os.strerror(e.errno)})",
                               feature="not_a_file", file=where) from None
        finally:
            os.close(fd)

    def _open(self, name: str, max_bytes: int) -> tuple[int, os.stat_result, str]:
        """(fd, stat, path for messages) of the regular file `name`, opened without
        following a link; AdapterError when absent, not a regular file or too large."""
        _check_name(name)
        where = f"{self.shown}/{name}"
        try:
            st = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            raise AdapterError(f"{name} is missing", feature="missing_file", file=where) from None
        except OSError as e:
            raise AdapterError(f"{name} cannot be examined ({os.strerror(e.errno)})",
                               feature="not_a_file", file=where) from None
        if not stat.S_ISREG(st.st_mode):
            raise AdapterError(f"{name} is a {_kind(st.st_mode)}, not a regular file (links "
                               "are not followed)", feature="not_a_file", file=where)
        if st.st_size > max_bytes:
            raise AdapterError(f"{name} is {st.st_size} bytes, more than the {max_bytes} an "
                               "adapter of this model can need", feature="file_size", file=where)
        try:
            return os.open(name, _FILE_FLAGS, dir_fd=self._fd), st, where
        except OSError as e:
            raise AdapterError(f"{name} cannot be opened ({os.strerror(e.errno)})",
                               feature="not_a_file", file=where) from None


def _read_whole(fd: int, before: os.stat_result, name: str, where: str,
                alloc: Alloc | None) -> FileRead:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (before.st_dev, before.st_ino):
        raise AdapterChangedError(f"{name} was replaced while being opened", file=where)
    if st.st_size != before.st_size:
        raise AdapterChangedError(f"{name} changed while being opened", file=where)
    size = st.st_size
    data = bytearray(size) if alloc is None else memoryview(alloc(size))[:size]
    view = memoryview(data)
    spans = chunk_spans(size)
    threads = min(HASH_THREADS, len(spans))
    hasher = ThreadPoolExecutor(threads) if len(spans) > 1 else None
    try:
        if threads > 1:
            got, chunks = _read_parallel(fd, view, spans, hasher)
        else:
            got, chunks = _read_in_order(fd, view, spans, hasher)
    finally:
        if hasher is not None:
            hasher.shutdown(wait=False)  # the chunks still hashing finish on their own
    after = os.fstat(fd)
    if got != size or os.pread(fd, 1, size) or _moved(st, after):
        raise AdapterChangedError(f"{name} changed while being read", file=where)
    return FileRead(data, chunks, st)


def _read_in_order(fd: int, view: memoryview, spans: range, hasher) -> tuple[int, list]:
    """Read the file front to back on this thread, each chunk hashed (on `hasher` when
    given) as soon as it is whole: (bytes read, digests or Futures of them)."""
    size, chunks, got = len(view), [], 0
    while True:
        while len(chunks) < len(spans) and min(spans[len(chunks)] + CHUNK, size) <= got:
            chunk = view[spans[len(chunks)]:spans[len(chunks)] + CHUNK]
            chunks.append(hasher.submit(chunk_hash, chunk) if hasher else chunk_hash(chunk))
        if got >= size:
            return got, chunks
        n = os.readv(fd, [view[got:got + CHUNK]])
        if n == 0:
            return got, chunks
        got += n


def _read_parallel(fd: int, view: memoryview, spans: range, pool) -> tuple[int, list]:
    """Read every chunk on `pool`'s threads at once (pread: no shared file offset), then
    hash them there: a page-cached file is read several times faster than by one thread,
    and the caller may use the bytes while the digests finish. Each hash task waits for
    its own chunk's read (all reads were queued first, so they all run before any hash
    task can wait)."""
    reads = [pool.submit(_pread_fully, fd, view[o:o + CHUNK], o) for o in spans]
    chunks = [pool.submit(_hash_read, r, view[o:o + CHUNK]) for r, o in zip(reads, spans)]
    return sum(r.result() for r in reads), chunks


def _pread_fully(fd: int, into: memoryview, offset: int) -> int:
    """Bytes read into `into` from `offset` (fewer only at the end of the file)."""
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _hash_read(read, chunk: memoryview) -> bytes:
    read.result()
    return chunk_hash(chunk)


def _moved(a: os.stat_result, b: os.stat_result) -> bool:
    """The content may have moved: a write changes the size or the mtime. (The ctime also
    moves on a chmod or a new hard link, which leave the bytes as they were.)"""
    return (a.st_size, a.st_mtime_ns) != (b.st_size, b.st_mtime_ns)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    return "special file (FIFO, socket or device)"


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"not a plain file name: {name!r}")


def _parts(rel: str, shown: str) -> list[str]:
    """The components of a path relative to a root; PathRefused for `..` or odd names."""
    if "\0" in rel:
        raise PathRefused(f"adapter path {shown!r} contains a NUL byte")
    parts = [p for p in PurePosixPath(rel).parts if p not in ("", ".", "/")]
    if ".." in parts:
        raise PathRefused(f"adapter path {shown!r} contains '..'")
    return parts


ROOTS_ENV = "LORAMUX_ADAPTER_ROOTS"


def roots_from(flags: list[str] | None, environ) -> tuple[str, ...]:
    """The adapter roots a process was given: its repeatable --adapter-root flags, else
    $LORAMUX_ADAPTER_ROOTS (':'-separated)."""
    if flags:
        return tuple(flags)
    return tuple(r for r in (environ or {}).get(ROOTS_ENV, "").split(":") if r)


def roots_problem(roots) -> str | None:
    """Why `roots` cannot serve as adapter roots (one is not a directory), or None."""
    bad = [r for r in roots if not os.path.isdir(r)]
    return f"adapter root(s) {', '.join(map(repr, bad))}: not a directory" if bad else None


class AdapterRoots:
    """The directories adapters may be read from, each opened once (the operator's own
    path to a root may contain links; nothing below a root may)."""

    def __init__(self, roots: list[str] | tuple[str, ...]):
        if not roots:
            raise ValueError("at least one adapter root is required")
        self.roots = [os.path.realpath(r) for r in roots]
        self._given = [os.path.abspath(r) for r in roots]
        self._fds = [os.open(r, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) for r in self.roots]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def locate(self, path: str) -> tuple[int, list[str]]:
        """(root index, components below it) of `path`, decided on the text alone:
        relative paths are taken from the first root. PathRefused otherwise."""
        if not path:
            raise PathRefused("adapter path is empty")
        if not os.path.isabs(path):
            return 0, _parts(path, path)
        norm = PurePosixPath(path)
        if ".." in norm.parts:
            raise PathRefused(f"adapter path {path!r} contains '..'")
        for i, (real, given) in enumerate(zip(self.roots, self._given)):
            for root in (real, given):
                if norm == PurePosixPath(root) or PurePosixPath(root) in norm.parents:
                    return i, _parts(str(norm.relative_to(root)), path)
        raise PathRefused(f"adapter path {path!r} is outside the adapter roots")

    def canonical(self, path: str) -> str:
        """The absolute path (under the root's real path) that `path` names; nothing is
        opened. PathRefused as in `locate`."""
        i, parts = self.locate(path)
        return os.path.join(self.roots[i], *parts)

    def open_dir(self, path: str) -> AdapterDir:
        """Open the adapter directory `path` below a root, component by component, never
        through a link. PathRefused when it leaves the roots or crosses a link;
        AdapterError when it does not exist or is not a directory."""
        i, parts = self.locate(path)
        if not parts:
            raise PathRefused(f"adapter path {path!r} is an adapter root itself, not a "
                              "directory inside one")
        fd = os.dup(self._fds[i])
        for k, part in enumerate(parts):  # each step closes the handle it starts from
            fd = _enter(fd, part, path, "/".join(parts[:k + 1]))
        return AdapterDir(fd, path)


def _enter(parent: int, part: str, shown: str, so_far: str) -> int:
    """Open `part` below `parent` as a directory without following a link; closes `parent`."""
    try:
        st = os.stat(part, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            raise PathRefused(f"adapter path {shown!r}: {so_far!r} is a symbolic link; links "
                              "below an adapter root are not followed")
        if not stat.S_ISDIR(st.st_mode):
            raise AdapterError(f"adapter path {shown!r}: {so_far!r} is not a directory",
                               feature="adapter_dir")
        return os.open(part, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise AdapterError(f"adapter path {shown!r}: {so_far!r} does not exist",
                           feature="adapter_dir") from None
    except OSError as e:  # a link or a non-directory swapped in after the stat
        if e.errno == errno.ENAMETOOLONG:
            raise AdapterError(f"adapter path {shown!r}: a component is too long",
                               feature="adapter_dir") from None
        raise PathRefused(f"adapter path {shown!r}: {so_far!r} cannot be opened as a "
                          f"directory ({os.strerror(e.errno)})") from None
    finally:
        os.close(parent)


def open_adapter_dir(path: str, roots: AdapterRoots | None) -> AdapterDir:
    """The adapter directory `path`: below `roots` when given; otherwise `path` itself is
    trusted as the anchor (an in-process caller named it) and only the files in it are
    opened without following links."""
    if roots is not None:
        return roots.open_dir(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AdapterError(f"adapter directory {path!r} does not exist",
                           feature="adapter_dir") from None
    except OSError as e:
        raise AdapterError(f"adapter directory {path!r} cannot be opened "
                           f"({os.strerror(e.errno)})", feature="adapter_dir") from None
    return AdapterDir(fd, str(path))

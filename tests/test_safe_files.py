"""loramux_core/safe_files.py: reads that cannot leave the adapter roots, hashed once,
and loramux_core/adapter/safetensors_buffer.py: headers that cannot lie."""
from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import struct

import pytest

from loramux_core.adapter.safetensors_buffer import parse_header
from loramux_core import safe_files
from loramux_core.errors import AdapterError
from loramux_core.safe_files import AdapterRoots, PathRefused, open_adapter_dir
from tests.support import digests


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "ok").mkdir(parents=True)
    (root / "ok" / "f").write_bytes(b"hello")
    (root / "deep" / "er").mkdir(parents=True)
    (root / "deep" / "er" / "f").write_bytes(b"x" * 100)
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    os.symlink(outside, root / "escape")
    os.symlink(root / "ok", root / "alias")          # a link that stays inside: still refused
    os.symlink(outside / "secret", root / "ok" / "link")
    os.mkfifo(root / "ok" / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "ok" / "sock"))
    yield root, outside
    sock.close()


def test_reads_whole_file_once_with_its_hash(tree):
    root, _ = tree
    roots = AdapterRoots([str(root)])
    with roots.open_dir("deep/er") as d:
        got = d.read("f", max_bytes=100)
    assert got.data == b"x" * 100 and got.digest == digests.v2(b"x" * 100)
    with roots.open_dir(str(root / "ok")) as d:     # absolute, under the root
        assert d.read("f", 5).data == b"hello"
    assert roots.canonical("ok") == str(root / "ok")


@pytest.mark.parametrize("size", [0, 1, (4 << 20) - 1, 4 << 20, (4 << 20) + 1, (9 << 20) + 7])
def test_large_files_hash_in_chunks_into_a_given_buffer(tmp_path, size):
    """Files of several chunks hash on threads while being read; the digest is the same
    function whatever the buffer, and one changed byte anywhere changes it."""
    from loramux_core.file_digest import file_digest, file_digest_v1, legacy_sha256
    data = random.Random(size).randbytes(size)
    (tmp_path / "f").write_bytes(data)
    given = bytearray(size + 100)
    with open_adapter_dir(str(tmp_path), None) as d:
        plain, into = d.read("f", size), d.read("f", size, alloc=lambda n: memoryview(given))
    assert plain.data == data and bytes(into.data) == data and len(into.data) == size
    assert plain.digest == into.digest == file_digest(data) == digests.v2(data)
    assert file_digest_v1(into.data) == digests.v1(data) != plain.digest
    assert legacy_sha256(into.data) == hashlib.sha256(data).hexdigest()
    if size:
        changed = bytearray(data)
        changed[size // 2] ^= 1
        assert file_digest(changed) != plain.digest


@pytest.mark.parametrize("path, why", [
    ("../outside", "'..'"), ("ok/../../outside", "'..'"), ("escape", "symbolic link"),
    ("alias", "symbolic link"), ("escape/secret", "symbolic link"), ("", "empty"),
    ("/etc", "outside the adapter roots"), (".", "adapter root itself")])
def test_paths_that_leave_the_root_or_cross_a_link(tree, path, why):
    root, outside = tree
    with pytest.raises(PathRefused) as ei:
        AdapterRoots([str(root)]).open_dir(path)
    assert why in str(ei.value)
    assert str(outside) not in str(ei.value)  # nothing about what lies beyond


def test_messages_do_not_tell_whether_an_outside_path_exists(tree):
    root, outside = tree
    roots = AdapterRoots([str(root)])
    msgs = []
    for p in (str(outside / "secret"), str(outside / "nope")):
        with pytest.raises(PathRefused) as ei:
            roots.open_dir(p)
        msgs.append(str(ei.value).replace(p, "P"))
    assert msgs[0] == msgs[1]


@pytest.mark.parametrize("name, kind", [("link", "symbolic link"), ("fifo", "special file"),
                                        ("sock", "special file"), ("missing", "missing")])
def test_files_that_are_not_regular_files(tree, name, kind):
    root, _ = tree
    with AdapterRoots([str(root)]).open_dir("ok") as d, pytest.raises(AdapterError) as ei:
        d.read(name, 100)
    assert kind in str(ei.value) and str(tree[1]) not in str(ei.value)


def test_size_limit_is_checked_before_reading(tree):
    root, _ = tree
    big = root / "ok" / "big"
    with open(big, "wb") as f:
        f.truncate(1 << 40)                       # sparse: a terabyte that is never read
    with AdapterRoots([str(root)]).open_dir("ok") as d, pytest.raises(AdapterError) as ei:
        d.read("big", 1 << 20)
    assert ei.value.feature == "file_size"


def test_file_growing_while_read_is_refused(tree, monkeypatch):
    root, _ = tree
    path = root / "ok" / "f"
    real_readv = os.readv

    def readv_then_append(fd, bufs):
        n = real_readv(fd, bufs)
        with open(path, "ab") as f:
            f.write(b"more")
        return n
    monkeypatch.setattr(safe_files.os, "readv", readv_then_append)
    with AdapterRoots([str(root)]).open_dir("ok") as d, pytest.raises(AdapterError) as ei:
        d.read("f", 100)
    assert ei.value.feature == "changed_on_disk"


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_reads_on_several_threads_give_the_same_bytes_and_digest(tree, monkeypatch, threads):
    """Chunks read at once on the hash threads (or in order on one): the file's bytes, and
    the digest file_digest gives them, whatever the thread count."""
    from loramux_core.file_digest import CHUNK, file_digest
    root, _ = tree
    data = random.Random(3).randbytes(4 * CHUNK + 12345)
    (root / "ok" / "big").write_bytes(data)
    monkeypatch.setattr(safe_files, "HASH_THREADS", threads)
    with AdapterRoots([str(root)]).open_dir("ok") as d:
        got = d.read("big", len(data))
    assert bytes(got.data) == data and got.digest == file_digest(data)


def test_file_growing_while_read_on_threads_is_refused(tree, monkeypatch):
    from loramux_core.file_digest import CHUNK
    root, _ = tree
    path = root / "ok" / "big"
    path.write_bytes(b"x" * (3 * CHUNK))
    real_preadv = os.preadv

    def preadv_then_append(fd, bufs, offset):
        n = real_preadv(fd, bufs, offset)
        with open(path, "ab") as f:
            f.write(b"more")
        return n
    monkeypatch.setattr(safe_files, "HASH_THREADS", 3)
    monkeypatch.setattr(safe_files.os, "preadv", preadv_then_append)
    with AdapterRoots([str(root)]).open_dir("ok") as d, pytest.raises(AdapterError) as ei:
        d.read("big", 10 * CHUNK)
    assert ei.value.feature == "changed_on_disk"


def test_trusted_anchor_without_roots_still_never_follows_file_links(tree):
    root, _ = tree
    with open_adapter_dir(str(root / "ok"), None) as d:
        assert d.read("f", 5).data == b"hello"
        with pytest.raises(AdapterError):
            d.read("link", 100)


def _st(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize("buf, why", [
    (b"\x01\x00", "shorter"),
    (struct.pack("<Q", 1 << 40) + b"{}", "exceeds"),
    (struct.pack("<Q", 4) + b"[[[[", "not JSON"),
    (struct.pack("<Q", 20000) + b"[" * 20000, "not JSON"),          # nesting
    (_st([], b""), "not a JSON object"),
    (_st({"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8"),
    (_st({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "cover"),
    (_st({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "gap"),
    (_st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "overlap"),
    (_st({"t": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, b"\0"), "unknown dtype"),
    (_st({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""), "shape"),
    (_st({"t": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, b"\0" * 8), "begin"),
    (_st({"t": {"dtype": "F32", "shape": [1 << 62, 1 << 62], "data_offsets": [0, 4]}}, b"\0" * 4),
     "needs"),
    (_st({"__metadata__": {"a": 1}}, b""), "__metadata__"),
])
def test_lying_safetensors_headers(buf, why, tmp_path):
    """Refused alike from the whole file and from its head alone (read_head: what the
    control plane checks before the engines read the file)."""
    (tmp_path / "w.safetensors").write_bytes(buf)
    with open_adapter_dir(str(tmp_path), None) as d:
        head, size = d.read_head("w.safetensors", 1 << 20, 1 << 20)
    assert size == len(buf) and buf.startswith(head)
    for args in ((buf,), (head, size)):
        with pytest.raises(AdapterError) as ei:
            parse_header(args[0], "w.safetensors", *args[1:])
        assert ei.value.feature == "safetensors" and why in str(ei.value), str(ei.value)


def test_header_of_a_real_file_matches_safetensors(tmp_path):
    import torch
    from safetensors.torch import save_file

    from loramux_engine.lora.tensor_view import tensor
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7, 2).to(torch.bfloat16),
               "c": torch.randn(4).double()}
    save_file(tensors, tmp_path / "w.safetensors", metadata={"format": "pt"})
    buf = (tmp_path / "w.safetensors").read_bytes()
    infos = parse_header(buf, "w")
    for k, t in tensors.items():
        assert torch.equal(tensor(buf, infos[k]), t)


def test_roots_from_flags_or_environment(tmp_path):
    from loramux_core.safe_files import roots_from, roots_problem
    assert roots_from(["/a", "/b"], {"LORAMUX_ADAPTER_ROOTS": "/c"}) == ("/a", "/b")
    assert roots_from(None, {"LORAMUX_ADAPTER_ROOTS": "/c::/d"}) == ("/c", "/d")
    assert roots_from(None, {}) == ()
    assert roots_problem([str(tmp_path)]) is None
    assert "not a directory" in roots_problem([str(tmp_path), str(tmp_path / "nope")])

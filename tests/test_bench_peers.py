"""benchmarks/bench_peers.py (`python -m benchmarks.kernels peers`): fetching the peers'
files from a wheel (pip against a folder of wheel-shaped zips made here, not their 100 MB
wheels), the manifest and its check, loading the files with the stand-ins for their
packages, and the whole case on the CPU (Triton's interpreter): with stand-in peers (one
agrees with the reference and is timed, one does not and is reported), with none (ours
alone, a skip line per peer), and with the real vLLM and SGLang files where they were
fetched into benchmarks/.peers."""
from __future__ import annotations

import json
import sys
import zipfile

import pytest
import torch

from benchmarks import kernels, peer_calls, suite
from benchmarks.peer_shims import load
from benchmarks.peer_sources import (DEFAULT_DIR, PEERS, PeerMissing, extract, fetch, find,
                                     sha256)
from tests.support.fake_peers import build_wheel


@pytest.fixture
def fake_peers(tmp_path):
    """benchmarks.peer_sources.fetch through pip from a folder of stand-in wheels."""
    def make(wrong: bool = False):
        wheels = tmp_path / ("wheels-wrong" if wrong else "wheels")
        for spec in PEERS.values():
            build_wheel(spec, wheels, wrong=wrong)
        dest = tmp_path / ("peers-wrong" if wrong else "peers")
        fetch(dest, ("--no-index", "--find-links", str(wheels)))
        return wheels, dest
    return make


def test_fetch_extracts_only_the_named_files_with_a_manifest(fake_peers):
    wheels, dest = fake_peers()
    for spec in PEERS.values():
        wheel = next(wheels.glob(f"{spec.name}-*.whl"))
        manifest = find(spec, dest)
        assert (manifest["wheel"], manifest["version"]) == (wheel.name, spec.version)
        assert manifest["sha256"] == sha256(wheel)
        with zipfile.ZipFile(wheel) as zf:
            taken = sorted(n for n in zf.namelist() if n.startswith(spec.name + "/")
                           and "/other/" not in n)
        assert sorted(manifest["files"]) == taken
        on_disk = sorted(str(p.relative_to(dest / spec.folder))
                         for p in (dest / spec.folder).rglob("*") if p.is_file())
        assert on_disk == sorted([*taken, "manifest.json"])
    assert not list(dest.rglob("*.whl"))           # the wheels went with the temporary folder


def test_find_names_what_is_missing_or_changed(fake_peers, tmp_path):
    _, dest = fake_peers()
    spec = PEERS["sglang"]
    changed = dest / spec.folder / spec.files[1]
    changed.write_text(changed.read_text() + "\n# edited\n")
    with pytest.raises(PeerMissing, match="chunked_sgmv_shrink.py is missing or changed"):
        find(spec, dest)
    with pytest.raises(PeerMissing, match="no .*vllm-0.33.0/manifest.json"):
        find(PEERS["vllm"], tmp_path / "nowhere")


def test_extract_refuses_another_version_or_a_missing_file(tmp_path):
    spec = PEERS["vllm"]
    wheel = build_wheel(spec, tmp_path / "w")
    renamed = wheel.with_name(wheel.name.replace(spec.version, "0.1.0"))
    wheel.rename(renamed)
    with pytest.raises(ValueError, match="is not a vllm 0.33.0 wheel"):
        extract(renamed, spec, tmp_path / "out")
    lacking = tmp_path / "w" / wheel.name
    with zipfile.ZipFile(renamed) as src, zipfile.ZipFile(lacking, "w") as dst:
        for n in src.namelist():
            if not n.endswith("lora_expand_op.py"):
                dst.writestr(n, src.read(n))
    with pytest.raises(ValueError, match="has no file .*lora_expand_op.py"):
        extract(lacking, spec, tmp_path / "out")


def test_load_stands_in_for_their_packages_and_leaves_none_behind(fake_peers):
    _, dest = fake_peers()
    vllm = load(PEERS["vllm"], dest / PEERS["vllm"].folder)
    utils = vllm["vllm.lora.ops.triton_ops.utils"]
    assert (utils.ON_CUDA, utils.TUNED, utils.POW2_OF_5) == (torch.cuda.is_available(), None, 8)
    shrink = vllm["vllm.lora.ops.triton_ops.lora_shrink_op"]
    assert shrink.lora_shrink is shrink._lora_shrink      # no torch op: their fallback
    sglang = load(PEERS["sglang"], dest / PEERS["sglang"].folder)
    config = sglang["sglang.kernels.ops.lora.dense.lora_tuning_config"]
    assert config.CONFIG == {"16": {"BLOCK_N": 16}}       # read from beside the file
    assert sglang["sglang.kernels.ops.lora.dense.chunked_sgmv_shrink"].SPLIT_K is False
    assert not [m for m in sys.modules if m.split(".")[0] in ("vllm", "sglang")]


def test_sglang_segments_follow_its_chunked_backend():
    assert [peer_calls.sglang_chunk(t, 16) for t in (1, 64, 2048)] == [16, 16, 16]
    assert [peer_calls.sglang_chunk(t, 128) for t in (1, 64, 255, 256)] == [16, 32, 32, 128]
    slots = torch.tensor([2, 0, 2, 2, 0, 2, 2])
    info = peer_calls.sglang_batch_info(slots, 3, 4, chunk=2)
    assert info.permutation.tolist() == [1, 4, 0, 2, 3, 5, 6]
    assert info.seg_indptr.tolist() == [0, 2, 4, 6, 7]
    assert info.weight_indices.tolist() == [0, 2, 2, 2]
    assert (info.num_segments, info.max_len, info.lora_ranks.tolist()) == (4, 2, [4, 4, 4])


# the --tiny case runs the kernels in Triton's interpreter, which a GPU host's tests do
# not use (tests/conftest.py): there the real case is the check (`kernels peers`)
interpreted = pytest.mark.skipif(torch.cuda.is_available(),
                                 reason="the CPU's interpreted --tiny case")


def _run(tmp_path, peers_dir, *extra) -> tuple[dict, str]:
    out = tmp_path / "out"
    rc = suite.main("kernels", kernels.CASES, ["peers", "--tiny", "--out", str(out),
                                               "--peers-dir", str(peers_dir), *extra])
    assert rc == 0
    return json.loads((out / "peers.json").read_text()), out


@interpreted
def test_stand_in_peers_are_checked_then_timed(fake_peers, tmp_path, capsys):
    _, dest = fake_peers(wrong=True)
    result, _ = _run(tmp_path, dest, "--groups", "qkv")
    rows = result["rows"]
    assert [(r["tokens"], r["adapters"], r["path"]) for r in rows] == [
        (1, 1, "tokens"), (5, 1, "tokens"), (5, 5, "tokens"), (272, 1, "tiles"),
        (272, 3, "tiles")]
    for r in rows:
        assert r["results"]["ours"]["us"] > 0 and r["results"]["vllm"]["us"] > 0
        assert r["results"]["sglang"]["status"].startswith("disagrees with the reference")
        assert "us" not in r["results"]["sglang"] and r["best_peer"] == "vllm"
        assert r["ours_over_best"] == r["ours_us"] / r["results"]["vllm"]["us"]
        assert r["floor_us"] > 0
    out = capsys.readouterr().out
    assert "| qkv | 8 | 272 | 3 | tiles |" in out and "| disagrees with the reference |" in out


@interpreted
def test_without_peers_ours_runs_and_each_peer_has_a_skip_line(tmp_path, capsys):
    result, _ = _run(tmp_path, tmp_path / "none", "--groups", "o")
    assert all(r["results"]["ours"]["us"] > 0 and set(r["results"]) == {"ours"}
               for r in result["rows"])
    out = capsys.readouterr().out.splitlines()
    assert "vllm: skipped: vllm 0.33.0: no " + str(tmp_path / "none" / "vllm-0.33.0" /
                                                   "manifest.json") in out
    assert any(line.startswith("sglang: skipped: sglang 0.5.23: no ") for line in out)
    assert "| o | 8 | 1 | 1 | tokens |" in "\n".join(out)


def test_a_real_run_without_peers_says_how_to_fetch_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc = suite.main("kernels", kernels.CASES, ["peers", "--out", str(tmp_path / "o"),
                                               "--peers-dir", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert rc == 2 and "python -m benchmarks.peer_sources fetch" in err
    assert "--ours-only" in err and "Traceback" not in err


def _fetched() -> bool:
    try:
        return all(find(spec, DEFAULT_DIR) for spec in PEERS.values())
    except PeerMissing:
        return False


@interpreted
@pytest.mark.skipif(not _fetched(), reason="the real peers are not fetched into "
                    "benchmarks/.peers (python -m benchmarks.peer_sources fetch)")
def test_the_real_peers_run_in_the_interpreter_and_agree(tmp_path):
    result, _ = _run(tmp_path, DEFAULT_DIR, "--groups", "o")
    assert all(v.startswith("ok") for v in result["implementations"].values())
    for r in result["rows"]:
        assert {n: "us" in v for n, v in r["results"].items()} == {
            "ours": True, "vllm": True, "sglang": True}, r["results"]


def test_the_summary_takes_the_best_peer_and_medians_by_phase():
    from benchmarks.peer_report import medians, summarize

    def row(tokens, ours, vllm, sglang):
        return summarize(dict(tokens=tokens, floor_us=5.0, results=dict(
            ours=dict(us=ours), vllm=dict(us=vllm) if vllm else dict(status="disagrees"),
            sglang=dict(us=sglang, chunk=16))))
    rows = [row(16, 10.0, 20.0, 25.0), row(64, 10.0, None, 40.0), row(2048, 50.0, 40.0, 100.0)]
    assert [(r["best_peer"], r["ours_over_best"]) for r in rows] == [
        ("vllm", 0.5), ("sglang", 0.25), ("vllm", 1.25)]
    assert (rows[0]["ours_pct_floor"], rows[0]["best_peer_pct_floor"]) == (50.0, 25.0)
    med = medians(rows)
    assert med["decode"] == dict(cases=2, ours_pct_floor=50.0, best_peer_pct_floor=18.75,
                                 ours_over_best=0.375)
    assert med["prefill"]["ours_over_best"] == 1.25

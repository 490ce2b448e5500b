"""Loads past a full host tier are lazy (engine/server/adapter_commands.py): checked
without reading the weights, registered on disk, read and checked in full at first use.
Their tokens are those of an eager load; a payload that fails its checks then, or files
changed since the load, fail only the requests naming that adapter, with
FAILED_PRECONDITION and the reason; what the header shows is refused at the load itself.
A real engine behind real ZMQ sockets (tests/support/served.py)."""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest
from safetensors.torch import load_file, save_file

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_core.v1 import engine_pb2
from tests.support.served import ServedEngine

WEIGHTS = "adapter_model.safetensors"
pytestmark = pytest.mark.timeout(300)


def config(family, **kw) -> EngineConfig:
    cfg = dict(model=str(family.model_dir), max_loras=1, max_cpu_loras=1, max_lora_rank=32,
               block_size=8, num_kv_blocks=64, max_num_batched_tokens=32)
    cfg.update(kw)
    return EngineConfig(**cfg)


def load(served, name: str, path) -> engine_pb2.AdapterAck:
    served.command(f"load-{name}", "load", name, str(path))
    msgs = served.collect(lambda m: m.WhichOneof("kind") == "adapter_ack"
                          and m.adapter_ack.command_id == f"load-{name}")
    return msgs[-1][1].adapter_ack


def outcome(served, request_ids: set[str]) -> dict:
    """request id -> ("tokens", [ids]) once finished, or ("error", code, message)."""
    got: dict = {rid: [] for rid in request_ids}
    done: dict = {}

    def until(m) -> bool:
        if m.WhichOneof("kind") == "step_batch":
            for d in m.step_batch.deltas:
                if d.request_id in got:
                    got[d.request_id] += d.token_ids
                    if d.finished:
                        done[d.request_id] = ("tokens", got[d.request_id])
            for e in m.step_batch.errors:
                if e.request_id in got:
                    done[e.request_id] = ("error", e.code, e.message)
        return set(done) == request_ids
    served.collect(until)
    return done


def eager_tokens(family, name: str, path, prompt, n: int) -> list[int]:
    with Engine(config(family, max_cpu_loras=4)) as eng:
        eng.add_adapter(name, path)
        return eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n,
                                                     ignore_eos=True), [name])[0].token_ids


def copy_adapter(family, name: str, dst):
    shutil.copytree(family.adapters[name], dst)
    return dst


def test_a_load_past_a_full_host_tier_is_read_at_first_use(llama_family):
    with Engine(config(llama_family)) as eng, ServedEngine(eng) as served:
        first = load(served, "rs4", llama_family.adapters["rs4"])
        assert first.ok and not first.version.startswith("stat-")  # read: there was room
        ack = load(served, "ap8", llama_family.adapters["ap8"])
        assert ack.ok, ack.message
        assert ack.version.startswith("stat-")  # its fingerprint: nothing read yet
        stats = {a["name"]: a for a in eng.stats()["adapters"].values()}
        assert stats["ap8"]["state"] == "disk" and stats["ap8"]["disk_reads"] == 0
        assert stats["rs4"]["state"] == "host" and stats["rs4"]["host_evictions"] == 0
        served.generate("r", [5, 6, 7], 6, adapter="ap8")
        got = outcome(served, {"r"})
        assert eng.stats()["adapters"][ack.adapter_id]["disk_reads"] == 1
    want = eager_tokens(llama_family, "ap8", llama_family.adapters["ap8"], [5, 6, 7], 6)
    assert got["r"] == ("tokens", want)


def test_a_bad_payload_fails_only_its_requests_at_first_use(llama_family, tmp_path):
    bad = copy_adapter(llama_family, "ap8", tmp_path / "bad")
    tensors = load_file(bad / WEIGHTS)
    key = sorted(k for k in tensors if "lora_B" in k)[3]
    tensors[key][0, 0] = float("nan")
    save_file(tensors, bad / WEIGHTS, metadata={"format": "pt"})
    with Engine(config(llama_family, max_cpu_loras=2)) as eng, ServedEngine(eng) as served:
        refused = load(served, "bad-now", bad)  # a free place: read and checked at once
        assert not refused.ok and refused.code == engine_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "non-finite" in refused.message
        assert load(served, "rs4", llama_family.adapters["rs4"]).ok
        assert load(served, "attn32", llama_family.adapters["attn32"]).ok  # tier full now
        ack = load(served, "bad", bad)
        assert ack.ok and ack.version.startswith("stat-"), ack.message
        served.generate("good", [5, 6, 7], 4, adapter="rs4")
        served.generate("r-bad", [5, 6, 7], 4, adapter="bad")
        done = outcome(served, {"good", "r-bad"})
        assert done["good"][0] == "tokens" and len(done["good"][1]) == 4
        code, message = done["r-bad"][1:]
        assert code == engine_pb2.ERROR_CODE_FAILED_PRECONDITION
        assert "adapter 'bad' cannot be served" in message and "non-finite" in message
        assert key in message
        assert "bad" not in {a["name"] for a in eng.stats()["adapters"].values()}
        served.generate("again", [5, 6, 7], 4, adapter="bad")  # the version was retired
        assert outcome(served, {"again"})["again"][1] == engine_pb2.ERROR_CODE_NOT_FOUND


def test_files_changed_between_load_and_first_read_are_refused(llama_family, tmp_path):
    path = copy_adapter(llama_family, "ap8", tmp_path / "changing")
    with Engine(config(llama_family)) as eng, ServedEngine(eng) as served:
        assert load(served, "rs4", llama_family.adapters["rs4"]).ok
        ack = load(served, "c", path)
        assert ack.ok and ack.version.startswith("stat-")
        tensors = load_file(path / WEIGHTS)  # other values, the same size and header
        time.sleep(0.05)  # past the file system's timestamp granularity
        save_file({k: v * 0.5 for k, v in tensors.items()}, path / WEIGHTS,
                  metadata={"format": "pt"})
        served.generate("r", [5, 6, 7], 4, adapter="c")
        code, message = outcome(served, {"r"})["r"][1:]
    assert code == engine_pb2.ERROR_CODE_FAILED_PRECONDITION
    assert "adapter 'c' cannot be served" in message and "changed" in message


def test_what_the_header_shows_is_refused_at_the_load(llama_family, tmp_path):
    path = copy_adapter(llama_family, "rs4", tmp_path / "wrong_rank")
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["r"] = 8  # the tensors are rank 4
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    with Engine(config(llama_family)) as eng, ServedEngine(eng) as served:
        assert load(served, "ap8", llama_family.adapters["ap8"]).ok
        ack = load(served, "wrong", path)
        assert not ack.ok and ack.code == engine_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "shape" in ack.message
        assert "wrong" not in {a["name"] for a in eng.stats()["adapters"].values()}


def test_a_pinned_load_reads_even_when_the_tier_is_full(llama_family):
    with Engine(config(llama_family, max_loras=2, max_cpu_loras=2)) as eng, \
            ServedEngine(eng) as served:
        assert load(served, "rs4", llama_family.adapters["rs4"]).ok
        assert load(served, "attn32", llama_family.adapters["attn32"]).ok  # tier full now
        served.command("pin-ap8", "load", "ap8", str(llama_family.adapters["ap8"]),
                       pinned=True)
        ack = served.collect(lambda m: m.WhichOneof("kind") == "adapter_ack")[-1][1].adapter_ack
        assert ack.ok and not ack.version.startswith("stat-"), ack.message
        assert eng.stats()["adapters"][ack.adapter_id]["state"] in ("host", "slot")


def test_the_fingerprint_changes_with_the_file_not_with_a_reread(llama_family, tmp_path):
    from loramux_core.adapter.plan import plan_adapter
    from loramux_core.model.hf_config import ModelConfig

    cfg = ModelConfig.from_dir(llama_family.model_dir)
    path = copy_adapter(llama_family, "rs4", tmp_path / "fp")
    head = plan_adapter(path, cfg, 32, header_only=True).fingerprint
    full = plan_adapter(path, cfg, 32)
    assert head == full.fingerprint and full.has_version(head) and not full.has_version(
        "stat-" + "0" * 64)
    data = (path / WEIGHTS).read_bytes()
    time.sleep(0.05)  # past the file system's timestamp granularity
    (path / WEIGHTS).write_bytes(data)  # the same bytes written again: a write all the same
    assert plan_adapter(path, cfg, 32, header_only=True).fingerprint != head


def test_the_fingerprint_ignores_metadata_but_not_a_replaced_file(llama_family, tmp_path):
    """A chmod or a new hard link changes only the ctime: the fingerprint stays; a file
    renamed over the weights (a new inode, even with the same bytes) changes it. A
    fingerprint recorded with the ctime, as before, is still honoured."""
    from loramux_core.adapter.plan import plan_adapter
    from loramux_core.file_digest import file_digest_v1, file_fingerprint
    from loramux_core.model.hf_config import ModelConfig

    cfg = ModelConfig.from_dir(llama_family.model_dir)
    path = copy_adapter(llama_family, "rs4", tmp_path / "fp")
    first = plan_adapter(path, cfg, 32, header_only=True)
    os.chmod(path / WEIGHTS, 0o400)
    os.link(path / WEIGHTS, tmp_path / "another-name")
    assert plan_adapter(path, cfg, 32, header_only=True).fingerprint == first.fingerprint
    full = plan_adapter(path, cfg, 32)
    assert full.has_version(first.fingerprint)
    assert full.has_version(full.legacy_fingerprint) and full.legacy_fingerprint.startswith(
        "stat-") and full.legacy_fingerprint != full.fingerprint
    head = bytes(full.weights[:8 + int.from_bytes(full.weights[:8], "little")])
    now = os.stat(path / WEIGHTS)
    assert full.legacy_fingerprint == file_fingerprint(  # over the config's v1 digest
        file_digest_v1(full.files[0][1].data), head, now, legacy=True)
    shutil.copy(path / WEIGHTS, tmp_path / "same-bytes")
    os.utime(tmp_path / "same-bytes", ns=(now.st_atime_ns, now.st_mtime_ns))
    os.replace(tmp_path / "same-bytes", path / WEIGHTS)  # a new inode, the same bytes
    assert plan_adapter(path, cfg, 32, header_only=True).fingerprint != first.fingerprint


def test_a_chmod_or_link_after_a_lazy_load_does_not_fail_the_first_read(llama_family,
                                                                         tmp_path):
    path = copy_adapter(llama_family, "ap8", tmp_path / "meta")
    with Engine(config(llama_family)) as eng, ServedEngine(eng) as served:
        assert load(served, "rs4", llama_family.adapters["rs4"]).ok
        ack = load(served, "m", path)
        assert ack.ok and ack.version.startswith("stat-")
        for name in (WEIGHTS, "adapter_config.json"):
            os.chmod(path / name, 0o444)
            os.link(path / name, tmp_path / f"link-{name}")
        served.generate("r", [5, 6, 7], 6, adapter="m")
        got = outcome(served, {"r"})
    assert got["r"] == ("tokens", eager_tokens(llama_family, "m", path, [5, 6, 7], 6))


def test_loading_a_lazily_loaded_name_again_changes_nothing(tmp_path):
    """Through the control plane: the engine acks the fingerprint, the registry keeps it,
    and LoadAdapter of the same files again is the no-op it is for a read adapter (the
    same id, not a reload)."""
    from loramux import AdminClient

    from loramux_services.launcher import Cluster, ClusterConfig
    from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

    model = make_model(tmp_path / "model", TinySpec())
    for i, name in enumerate(("a1", "a2")):
        make_adapter(tmp_path / "adapters" / name, model, AdapterSpec(seed=50 + i))
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(tmp_path / "adapters"),),
                        workdir=str(tmp_path / "run"),
                        engine_args=("--max-loras", "1", "--max-cpu-loras", "1"),
                        env={"OMP_NUM_THREADS": "1"})
    with Cluster(cfg) as cluster:
        cluster.start("engine", "control")
        cluster.wait_ready("engine", "control")
        with AdminClient(cluster.control_address) as admin:
            admin.load("a1", "a1")
            lazy = admin.load("a2", "a2")  # no free host place: checked, not read
            again = admin.load("a2", "a2")
            assert again.id == lazy.id != 0  # the same version: not loaded again


def test_every_hostile_adapter_is_refused_lazily_too(tmp_path):
    """The hostile corpus (tests/support/adapter_fuzz.py) through lazy registration: what
    the checks without weights can see is refused at the load with the status an eager load
    gets; the rest (values: NaN, inf, overflow once scaled) is registered, and its first
    request ends with FAILED_PRECONDITION naming the problem, while a good adapter's
    request beside it is served."""
    from loramux_core.errors import AdapterError, error_code
    from tests.support.adapter_fuzz import write_corpus
    from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

    model = make_model(tmp_path / "model", TinySpec())
    root = tmp_path / "adapters"
    good = make_adapter(root / "good", model, AdapterSpec(seed=21))
    corpus = [c for c in write_corpus(root, good, tmp_path / "outside")
              if not os.path.isabs(c.path)]
    cfg = EngineConfig(model=str(model), max_loras=1, max_cpu_loras=1, max_lora_rank=64,
                       block_size=8, num_kv_blocks=64, adapter_roots=(str(root),))
    deferred = []
    with Engine(cfg) as eng:
        eng.add_adapter("good", "good")
        for case in corpus:
            try:
                eng.read_adapter(case.name, case.path)
            except AdapterError as err:
                eager = err
            else:
                raise AssertionError(f"{case.what}: an eager load accepted it")
            try:
                read = eng.read_adapter(case.name, case.path, lazy=True)
            except AdapterError as err:
                assert error_code(err) == error_code(eager), (case.what, err, eager)
                continue
            assert eager.feature in ("non_finite", "magnitude"), (case.what, eager)
            eng.register_adapter(read)
            deferred.append(case)
            eng.add_request(f"bad-{case.name}", [5, 6, 7], SamplingParams(max_tokens=2),
                            case.name)
            eng.add_request(f"good-{case.name}", [5, 6, 7], SamplingParams(max_tokens=2),
                            "good")
            outs = []
            while eng.has_unfinished():
                outs += eng.step()
            bad = [o for o in outs if o.request_id == f"bad-{case.name}"]
            assert len(bad) == 1 and bad[0].finished and bad[0].error is not None, case.what
            assert error_code(bad[0].error) == engine_pb2.ERROR_CODE_FAILED_PRECONDITION
            assert str(eager) in str(bad[0].error), (case.what, bad[0].error)  # same reason
            good_tokens = [t for o in outs if o.request_id == f"good-{case.name}"
                           for t in o.new_token_ids]
            assert len(good_tokens) == 2, case.what
    assert len(deferred) >= 60 and len(corpus) > 300  # 406 and 64 when written

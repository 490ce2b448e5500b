"""The persisted adapter registry is bound to its base model and adapter roots: a start
with another model or other roots replays nothing from the old registry (and logs what it
skipped); going back to the first model brings its adapters back."""
from __future__ import annotations

import json
import shutil

import pytest
from loramux import AdminClient
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_services.control.binding import binding_for, model_fingerprint, prepare
from loramux_services.control.registry import AdapterRecord, Registry
from loramux_services.launcher import Cluster
from tests.support.replay import replayed, start_engine_and_control
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = pytest.mark.timeout(300)


class _Log:
    def __init__(self):
        self.records = []

    def warning(self, event, **kw):
        self.records.append((event, kw))

    info = warning


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("binding")
    a = make_model(root / "model-a", TinySpec(seed=0))
    b = make_model(root / "model-b", TinySpec(seed=1))  # same shapes, other weights
    make_adapter(root / "adapters" / "x", a, AdapterSpec(seed=3))
    (root / "other-adapters").mkdir()
    return root


def test_fingerprint_is_content_not_location(files, tmp_path):
    copy = shutil.copytree(files / "model-a", tmp_path / "copy")
    assert model_fingerprint(str(copy)) == model_fingerprint(str(files / "model-a"))
    assert model_fingerprint(str(files / "model-b")) != model_fingerprint(str(files / "model-a"))
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (copy / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(str(copy)) != model_fingerprint(str(files / "model-a"))


def _open(db, model, roots, log):
    binding = binding_for(str(model), [str(r) for r in roots])
    prepare(db, binding, log)
    return Registry(db, binding.to_json())


def test_prepare_sets_aside_and_restores(files, tmp_path):
    db = str(tmp_path / "registry.sqlite")
    adapters, other = files / "adapters", files / "other-adapters"
    reg = _open(db, files / "model-a", [adapters], _Log())
    reg.put(AdapterRecord("x", str(adapters / "x"), state=pb.ADAPTER_STATE_LOADED))
    reg.close()
    for model, roots in ((files / "model-b", [adapters]), (files / "model-a", [other]),
                         (files / "model-a", [adapters, other])):
        log = _Log()
        reg = _open(db, model, roots, log)
        assert reg.all() == [], (model, roots)
        reg.close()
    # the first one's skip was logged with the adapter it held
    log = _Log()
    reg = _open(db, files / "model-a", [adapters], log)
    assert [r.name for r in reg.all()] == ["x"]  # set aside earlier, now back
    assert [e for e, _ in log.records] == ["registry_restored"]
    reg.close()
    log = _Log()
    _open(db, files / "model-b", [adapters], log).close()
    event, kw = log.records[0]
    assert event == "registry_skipped"
    assert kw["adapters"] == [{"name": "x", "path": str(adapters / "x"),
                               "state": pb.ADAPTER_STATE_LOADED}]


def test_unbound_registry_is_notreplayed(files, tmp_path):
    db = str(tmp_path / "registry.sqlite")
    old = Registry(db)  # as written before registries carried a binding
    old.put(AdapterRecord("x", str(files / "adapters" / "x"), state=pb.ADAPTER_STATE_LOADED))
    old.close()
    log = _Log()
    reg = _open(db, files / "model-a", [files / "adapters"], log)
    assert reg.all() == [] and log.records[0][0] == "registry_skipped"


def _start(files, model: str, workdir) -> Cluster:
    return start_engine_and_control(files / model, files / "adapters", workdir)


def test_another_model_replays_nothing(files, tmp_path):
    """Real engine and control plane processes sharing one work dir, as `loramux serve`
    does across restarts."""
    with _start(files, "model-a", tmp_path) as c:
        with AdminClient(c.control_address) as admin:
            admin.load("x", "x")
        assert replayed(c) == {"x"}
    with _start(files, "model-b", tmp_path) as c:
        assert replayed(c) == set()
        with AdminClient(c.control_address) as admin:
            assert list(admin.list()) == []
        skipped = [json.loads(line) for line in c.log_tail("control", 100_000).splitlines()
                   if '"registry_skipped"' in line]
        assert [a["name"] for a in skipped[0]["adapters"]] == ["x"]
    with _start(files, "model-a", tmp_path) as c:  # back: its adapters come back
        assert replayed(c) == {"x"}

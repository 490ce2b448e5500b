"""Hostile adapters, paths and Generate requests against the real service (engine, control
plane and gateway as processes, real gRPC): every case gets its exact status code within
5 s, the service then serves the same greedy tokens as before, and no service process
opened anything outside the adapter roots (Python audit hook, loramux_core/open_audit.py).

The corpus (tests/support/adapter_fuzz.py) is run against one cluster, one call per case."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import grpc
import pytest
from loramux import AdminClient, GenerateClient, LoramuxError
from loramux.v1 import generate_pb2, generate_pb2_grpc

from loramux_core.open_audit import ENV as AUDIT_ENV
from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.support.adapter_fuzz import CANARY, CONFIG, WEIGHTS, path_attacks, write_corpus
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

TOKEN = "fuzz-token"
PROMPTS = ["the quick brown fox", "once upon a time"]
MAX_CASE_S = 5.0
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    model = make_model(root / "model", TinySpec())
    adapters, outside = root / "adapters", root / "outside"
    good = make_adapter(adapters / "good", model, AdapterSpec(seed=21))
    shutil.copytree(good, outside / CANARY)  # a valid adapter: following a link would work
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (outside / CANARY / "chat_template.jinja").write_text("stolen " + template)
    for name in ("tmpl-ok", "tmpl-link", "tmpl-fifo", "tmpl-swap"):
        shutil.copytree(good, adapters / name)
    for name in ("tmpl-ok", "tmpl-swap"):
        (adapters / name / "chat_template.jinja").write_text(template)
    os.symlink(outside / CANARY / "chat_template.jinja", adapters / "tmpl-link" / "chat_template.jinja")
    os.mkfifo(adapters / "tmpl-fifo" / "chat_template.jinja")
    corpus = write_corpus(adapters, good, outside)
    attacks = path_attacks(adapters, outside, "good")
    return {"root": root, "model": str(model), "adapters": adapters, "outside": outside,
            "corpus": corpus, "attacks": attacks}


@pytest.fixture(scope="module")
def cluster(files):
    audit = files["root"] / "audit" / "open"
    audit.parent.mkdir()
    cfg = ClusterConfig(model=files["model"], adapter_roots=(str(files["adapters"]),),
                        workdir=str(files["root"] / "run"), auth_token=TOKEN,
                        env={"OMP_NUM_THREADS": "1", AUDIT_ENV: str(audit)})
    c = Cluster(cfg)
    c.start()
    try:
        c.wait_ready()
        wait_serving(c.gateway_address)
        c.audit_prefix = audit
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def admin(cluster):
    with AdminClient(cluster.control_address, token=TOKEN) as a:
        a.load("good", "good")
        yield a


@pytest.fixture(scope="module")
def gen(cluster, admin):
    with GenerateClient(cluster.gateway_address) as g:
        yield g


def greedy_tokens(gen) -> list[list[int]]:
    out = []
    for adapter in ("good", None):
        for p in PROMPTS:
            out.append(list(gen.generate(p, adapter, max_tokens=12, temperature=0.0).token_ids))
    return out


@pytest.fixture(scope="module")
def baseline(gen):
    return greedy_tokens(gen)


def run_cases(cases, call) -> list[str]:
    """Each case's call, timed; the mismatches (code or time) as messages."""
    wrong = []
    for c in cases:
        t0 = time.monotonic()
        try:
            call(c)
            got = "OK"
        except LoramuxError as err:
            got, details = err.code.name, err.details
        took = time.monotonic() - t0
        if got != c.code or took > MAX_CASE_S:
            wrong.append(f"{c.name} {c.what}: {got} in {took:.2f} s, expected {c.code}"
                         + (f" ({details[:160]})" if got != "OK" else ""))
    return wrong


def test_malformed_adapters_get_their_exact_code(files, admin, baseline):
    corpus = files["corpus"]
    assert len(corpus) >= 300
    wrong = run_cases(corpus, lambda c: admin.load(c.name, c.path))
    assert not wrong, "\n".join(wrong)
    assert [a.name for a in admin.list()] == ["good"]  # refused loads leave nothing behind


def test_path_attacks_are_refused(files, admin, baseline):
    attacks = files["attacks"]
    assert len(attacks) >= 50
    wrong = run_cases(attacks, lambda c: admin.register(c.name, c.path))
    assert not wrong, "\n".join(wrong)
    assert [a.name for a in admin.list()] == ["good"]


def test_refusals_reveal_nothing_outside_the_roots(files, admin):
    """The same message shape whether the outside path exists or not, and never a word of
    what lies beyond a link."""
    outside = files["outside"]
    msgs = []
    for p in (str(outside / CANARY), str(outside / "no-such-dir")):
        with pytest.raises(LoramuxError) as info:
            admin.register("probe", p)
        msgs.append(info.value.details.replace(p, "<path>"))
    assert msgs[0] == msgs[1]
    with pytest.raises(LoramuxError) as info:
        admin.register("probe", "l-out")
    assert str(outside) not in info.value.details and CANARY not in info.value.details


def _raw_generate(cluster, req: generate_pb2.GenerateRequest):
    with grpc.insecure_channel(cluster.gateway_address) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        for _ in stub.Generate(req, timeout=MAX_CASE_S):
            pass


def _sp(**kw) -> generate_pb2.SamplingParams:
    stop = kw.pop("stop", ())
    stop_ids = kw.pop("stop_token_ids", ())
    sp = generate_pb2.SamplingParams(**kw)
    sp.stop.extend(stop)
    sp.stop_token_ids.extend(stop_ids)
    return sp


MALFORMED_GENERATE = [
    ("empty prompt", dict(text=""), "INVALID_ARGUMENT"),
    ("no prompt at all", dict(), "INVALID_ARGUMENT"),
    ("empty token ids", dict(token_ids=generate_pb2.TokenIds(ids=[])), "INVALID_ARGUMENT"),
    ("negative token id", dict(token_ids=generate_pb2.TokenIds(ids=[5, -1])), "INVALID_ARGUMENT"),
    ("token id past the vocab", dict(token_ids=generate_pb2.TokenIds(ids=[5, 10 ** 6])),
     "INVALID_ARGUMENT"),
    ("prompt over the context", dict(token_ids=generate_pb2.TokenIds(ids=[5] * 5000)),
     "INVALID_ARGUMENT"),
    ("max_tokens 0", dict(sampling=_sp(max_tokens=0)), "INVALID_ARGUMENT"),
    ("max_tokens -5", dict(sampling=_sp(max_tokens=-5)), "INVALID_ARGUMENT"),
    ("max_tokens over the context", dict(sampling=_sp(max_tokens=2 ** 31 - 1)), "INVALID_ARGUMENT"),
    ("temperature NaN", dict(sampling=_sp(temperature=float("nan"))), "INVALID_ARGUMENT"),
    ("temperature -1", dict(sampling=_sp(temperature=-1.0)), "INVALID_ARGUMENT"),
    ("temperature inf", dict(sampling=_sp(temperature=float("inf"))), "INVALID_ARGUMENT"),
    ("top_p 0", dict(sampling=_sp(top_p=0.0)), "INVALID_ARGUMENT"),
    ("top_p 1.5", dict(sampling=_sp(top_p=1.5)), "INVALID_ARGUMENT"),
    ("top_p NaN", dict(sampling=_sp(top_p=float("nan"))), "INVALID_ARGUMENT"),
    ("top_k -5", dict(sampling=_sp(top_k=-5)), "INVALID_ARGUMENT"),
    ("min_p 2", dict(sampling=_sp(min_p=2.0)), "INVALID_ARGUMENT"),
    ("min_p NaN", dict(sampling=_sp(min_p=float("nan"))), "INVALID_ARGUMENT"),
    ("repetition_penalty 0", dict(sampling=_sp(repetition_penalty=0.0)), "INVALID_ARGUMENT"),
    ("repetition_penalty NaN", dict(sampling=_sp(repetition_penalty=float("nan"))),
     "INVALID_ARGUMENT"),
    ("repetition_penalty -inf", dict(sampling=_sp(repetition_penalty=float("-inf"))),
     "INVALID_ARGUMENT"),
    ("1000 stop strings", dict(sampling=_sp(stop=["x"] * 1000)), "INVALID_ARGUMENT"),
    ("empty stop string", dict(sampling=_sp(stop=[""])), "INVALID_ARGUMENT"),
    ("stop token past the vocab", dict(sampling=_sp(stop_token_ids=[10 ** 6])), "INVALID_ARGUMENT"),
    ("negative stop token", dict(sampling=_sp(stop_token_ids=[-3])), "INVALID_ARGUMENT"),
    ("top_logprobs 1000", dict(sampling=_sp(logprobs=True, top_logprobs=1000)), "INVALID_ARGUMENT"),
    ("top_logprobs -1", dict(sampling=_sp(logprobs=True, top_logprobs=-1)), "INVALID_ARGUMENT"),
    ("adapter name with a slash", dict(adapter="../good"), "NOT_FOUND"),
    ("adapter unknown", dict(adapter="nobody"), "NOT_FOUND"),
    ("adapter name with NUL", dict(adapter="go\0od"), "NOT_FOUND"),
    ("empty chat", dict(messages=generate_pb2.ChatMessages()), "INVALID_ARGUMENT"),
    ("chat with an unknown role", dict(messages=generate_pb2.ChatMessages(
        messages=[generate_pb2.ChatMessage(role="\0", content="x")])), None),
    # accepted: only echoed back, within the gateway's message size limit
    ("request id of 1 MiB", dict(request_id="r" * (1 << 20)), "OK"),
]


def test_malformed_generate_requests(cluster, gen, baseline):
    wrong = []
    for what, fields, code in MALFORMED_GENERATE:
        req = generate_pb2.GenerateRequest(**{"text": "hello", **fields}) \
            if not ({"text", "token_ids", "messages"} & set(fields)) and what != "no prompt at all" \
            else generate_pb2.GenerateRequest(**fields)
        t0 = time.monotonic()
        try:
            _raw_generate(cluster, req)
            got = "OK"
        except grpc.RpcError as err:
            got = err.code().name
        took = time.monotonic() - t0
        if got in ("UNKNOWN", "INTERNAL") or (code is not None and got != code) \
                or took > MAX_CASE_S:
            wrong.append(f"{what}: {got} in {took:.2f} s, expected {code or 'a precise code'}")
    assert not wrong, "\n".join(wrong)


def test_adapter_chat_templates_are_read_inside_the_roots(files, cluster, admin, baseline):
    """The gateway reads an adapter's chat template like the engine reads its weights: a
    link or a FIFO in place of the file, or the adapter's directory swapped for a link
    after it was loaded, is FAILED_PRECONDITION at once, never a read outside the roots."""
    for name in ("tmpl-ok", "tmpl-link", "tmpl-fifo", "tmpl-swap"):
        admin.load(name, name)
    swapped = files["adapters"] / "tmpl-swap"
    shutil.rmtree(swapped)
    os.symlink(files["outside"] / CANARY, swapped)
    chat = generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(role="user", content="hi")])
    got = {}
    try:
        for name in ("tmpl-ok", "tmpl-link", "tmpl-fifo", "tmpl-swap"):
            t0 = time.monotonic()
            try:
                _raw_generate(cluster, generate_pb2.GenerateRequest(
                    messages=chat, adapter=name, sampling=_sp(max_tokens=2)))
                got[name] = ("OK", "")
            except grpc.RpcError as err:
                got[name] = (err.code().name, err.details())
            assert time.monotonic() - t0 < MAX_CASE_S, name
    finally:
        for name in ("tmpl-ok", "tmpl-link", "tmpl-fifo", "tmpl-swap"):
            admin.unload(name)
        for name in ("tmpl-ok", "tmpl-link", "tmpl-fifo", "tmpl-swap"):
            _unregister_when_unloaded(admin, name)
    assert got["tmpl-ok"][0] == "OK", got
    for name, why in (("tmpl-link", "symbolic link"), ("tmpl-fifo", "special file"),
                      ("tmpl-swap", "symbolic link")):
        code, details = got[name]
        assert code == "FAILED_PRECONDITION" and why in details, (name, got[name])
        assert str(files["outside"]) not in details and "stolen" not in details


def _unregister_when_unloaded(admin, name: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            admin.unregister(name)
            return
        except LoramuxError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_files_changed_after_registration_are_refused(files, admin, baseline):
    """The version is the hash of the bytes: one weight changed after registration (same
    size, same mtime) makes the engine refuse the load; registering again accepts it."""
    d = files["adapters"] / "changed"
    shutil.copytree(files["adapters"] / "good", d)
    admin.register("changed", "changed")
    weights = d / WEIGHTS
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(LoramuxError) as info:
        admin.load("changed")
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION, info.value.details
    assert "changed" in info.value.details
    admin.register("changed", "changed")       # the files as they are now
    admin.load("changed")
    admin.unload("changed")
    _unregister_when_unloaded(admin, "changed")


def test_still_serves_identical_greedy_outputs(gen, baseline, admin):
    assert greedy_tokens(gen) == baseline
    assert [a.name for a in admin.list()] == ["good"]


def _audited_opens(cluster) -> list[tuple[str, int | None, str]]:
    out = []
    for log in sorted(cluster.audit_prefix.parent.glob(cluster.audit_prefix.name + ".*")):
        for line in log.read_text().splitlines():
            path, flags = json.loads(line)
            out.append((path, flags, log.name))
    return out


def test_no_file_outside_the_roots_was_opened(files, cluster, baseline):
    """Every open of every service process since it started: none names the outside
    directory (the canary), none names a file a hostile link pointed at, and every open by
    a bare name (relative to a directory handle) of a name that exists in the adapter tree
    carries O_NOFOLLOW, so the kernel followed no link."""
    opens = _audited_opens(cluster)
    processes = {log.split(".")[1] for _, _, log in opens}
    assert {"engine", "control", "gateway"} <= processes
    assert any(p == CONFIG for p, _, _ in opens)  # the hook sees the adapter reads
    outside = str(files["outside"])
    forbidden = (outside, CANARY, "/etc/passwd", "/dev/zero")
    bad = [o for o in opens if any(f in o[0] for f in forbidden)]
    assert not bad, bad[:10]
    tree_names = {n for _, dirs, names in os.walk(files["adapters"]) for n in dirs + names}
    loose = [o for o in opens if not o[0].startswith("/") and os.path.basename(o[0]) in tree_names
             and not ((o[1] or 0) & os.O_NOFOLLOW)]
    assert not loose, loose[:10]


def test_audit_hook_would_see_a_stray_open(tmp_path):
    """The check above can fail: a process with the hook that opens the canary logs it."""
    import subprocess
    import sys
    target = tmp_path / CANARY
    target.write_text("x")
    prefix = tmp_path / "open"
    code = ("from loramux_core import open_audit; open_audit.install_from_env('probe'); "
            f"open({str(target)!r}).read()")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ,
                                                                  AUDIT_ENV: str(prefix)})
    logged = [json.loads(line)[0] for p in tmp_path.glob("open.probe.*")
              for line in p.read_text().splitlines()]
    assert str(target) in logged


_READ_ALL = """
import sys
from loramux_core.safe_files import AdapterRoots
from loramux_core.errors import AdapterError
from loramux_engine.lora import load_lora
from loramux_core.model.hf_config import ModelConfig
model, root, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
mc, roots = ModelConfig.from_dir(model), AdapterRoots([root])
print("READING", flush=True)
for p in paths:
    try:
        load_lora(p, mc, 64, roots=roots)
    except AdapterError:
        pass
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_kernel_opened_nothing_outside_the_roots(files):
    """The kernel's view (strace -y prints the file every returned descriptor names): the
    service's adapter reader, run over the whole corpus and every path attack, obtains no
    descriptor for anything outside the root."""
    import subprocess
    import sys
    log = files["root"] / "strace.log"
    paths = [c.path for c in files["corpus"] + files["attacks"] if "\0" not in c.path]
    cmd = ["strace", "-f", "-y", "-qq", "-e", "trace=open,openat,openat2", "-o", str(log),
           sys.executable, "-c", _READ_ALL, files["model"], str(files["adapters"]), *paths]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    if run.returncode != 0 and "ptrace" in run.stderr:
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = log.read_text().splitlines()
    opened = [line.rsplit("= ", 1)[1] for line in lines if "= " in line
              and not line.rsplit("= ", 1)[1].startswith("-")]
    adapter_reads = [o for o in opened if str(files["adapters"]) in o]
    assert any(o.endswith(f"/{CONFIG}>") for o in adapter_reads)
    assert any(o.endswith(f"/{WEIGHTS}>") for o in adapter_reads)
    leaked = [o for o in opened if str(files["outside"]) in o or CANARY in o
              or "/etc/passwd" in o or "/dev/zero" in o]
    assert not leaked, leaked[:10]

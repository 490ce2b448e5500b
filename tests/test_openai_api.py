"""The OpenAI-compatible HTTP API against a real `loramux serve` (control plane, engine and
gateway processes on loopback), driven by the official `openai` client, sync and async,
streamed and not: the same tokens as the gRPC path for the base model and two adapters in
one run, /v1/models following loads and unloads, errors in OpenAI's shape. On the same
server: the gRPC errors' details (field violations, RetryInfo) and the SDK's retries."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from loramux import AdminClient, GenerateClient, LoramuxError

from loramux_core.tokenizer import Tokenizer
from loramux_services.common.chat_template import ChatTemplate
from loramux_services.launcher import free_port, wait_serving
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

TOKEN = "http-s3cret"
CHATML = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
          "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
OWN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
MESSAGES = [{"role": "system", "content": "a tiny model that could"},
            {"role": "user", "content": "héllo wörld, ça va?"}]
PROMPTS = ["the quick brown fox", "once upon a time", "def main():"]
MAX_INFLIGHT = 6
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    model = make_model(root / "model", TinySpec())
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    adapters = root / "adapters"
    for i, name in enumerate(("a1", "a2", "a3"), start=1):
        make_adapter(adapters / name, model, AdapterSpec(seed=30 + i))
    (adapters / "a2" / "chat_template.jinja").write_text(OWN)  # a2 brings its own template
    return {"root": root, "model": str(model), "adapters": str(adapters)}


def _http(base: str, path: str, body: dict | None = None, token: str | None = TOKEN,
          data: bytes | None = None) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if data is None and body is not None:
        data = json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, status = resp.read().decode(), resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read().decode(), err.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


@pytest.fixture(scope="module")
def server(files):
    """`loramux serve` on free ports; yields its addresses."""
    ports = {name: free_port() for name in ("gateway", "control", "metrics", "http")}
    cmd = [sys.executable, "-m", "loramux.cli", "serve", "--model", files["model"],
           "--adapter-root", files["adapters"], "--device", "cpu", "--auth-token", TOKEN,
           "--workdir", str(files["root"] / "run"),
           *(a for name, port in ports.items() for a in (f"--{name}-port", str(port)))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LORAMUX_MAX_INFLIGHT": str(MAX_INFLIGHT),
           "LORAMUX_MAX_MESSAGE_BYTES": str(1 << 20)}
    log = open(files["root"] / "serve.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        deadline = time.monotonic() + 120
        while _health(base) != 200:
            assert proc.poll() is None, (files["root"] / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the HTTP API did not come up"
            time.sleep(0.2)
        wait_serving(f"127.0.0.1:{ports['gateway']}")
        yield {"base": base, "gateway": f"127.0.0.1:{ports['gateway']}",
               "control": f"127.0.0.1:{ports['control']}",
               "metrics": f"http://127.0.0.1:{ports['metrics']}/metrics"}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _health(base: str) -> int | None:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


@pytest.fixture(scope="module")
def admin(server):
    with AdminClient(server["control"], token=TOKEN) as a:
        a.load("a1", "a1")
        a.load("a2", "a2")
        _wait_models(server["base"], {"a1", "a2"})
        yield a


@pytest.fixture(scope="module")
def grpc_client(server, admin):
    with GenerateClient(server["gateway"]) as g:
        yield g


@pytest.fixture(scope="module")
def client(server, admin):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=TOKEN, max_retries=0)


@pytest.fixture(scope="module")
def base_model(files):
    """The base model's served name: its directory's name, never the path."""
    return Path(files["model"]).name


def _model_ids(base: str) -> set[str]:
    status, body = _http(base, "/v1/models")
    assert status == 200, body
    return {m["id"] for m in body["data"]}


def _wait_models(base: str, want: set[str], absent: set[str] = frozenset(), timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        ids = _model_ids(base)
        if want <= ids and not (absent & ids):
            return ids
        assert time.monotonic() < deadline, f"/v1/models has {sorted(ids)}"
        time.sleep(0.05)


# ---- /v1/models ---------------------------------------------------------------------

def test_models_lists_base_and_loaded_adapters(server, admin, client, files, base_model):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {base_model, "a1", "a2"}
    base = models[base_model].model_dump()
    assert base["parent"] is None and base["root"] == files["model"]
    for name in ("a1", "a2"):
        entry = models[name].model_dump()
        assert entry["parent"] == base_model
        assert entry["root"] == os.path.realpath(os.path.join(files["adapters"], name))
        assert entry["object"] == "model" and entry["owned_by"] == "loramux"
    assert client.models.retrieve("a1").id == "a1"
    assert not any(os.sep in m for m in models)  # names, no paths


def test_base_model_by_name_and_by_its_path(client, files, base_model):
    """`model` = the served name; the directory as given (the name served before) still
    names the base model."""
    by_name = client.completions.create(model=base_model, prompt=PROMPTS[0], max_tokens=6,
                                        temperature=0.0)
    by_path = client.completions.create(model=files["model"], prompt=PROMPTS[0], max_tokens=6,
                                        temperature=0.0)
    assert by_name.model == base_model and by_name.choices[0].text
    assert by_path.choices[0].text == by_name.choices[0].text


def test_models_follow_loads_and_unloads(server, admin):
    admin.load("a3", "a3")
    _wait_models(server["base"], {"a3"})
    admin.unload("a3")
    _wait_models(server["base"], set(), absent={"a3"})
    status, body = _http(server["base"], "/v1/completions",
                         {"model": "a3", "prompt": "the", "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found"


# ---- same tokens as gRPC ------------------------------------------------------------

def _grpc_tokens(grpc_client, prompt, adapter, **kw):
    return grpc_client.generate(prompt, adapter, temperature=0.0, **kw).token_ids


def test_completions_sync_match_grpc(client, grpc_client, base_model):
    for model, adapter in ((base_model, None), ("a1", "a1"), ("a2", "a2")):
        out = client.completions.create(model=model, prompt=PROMPTS, max_tokens=10,
                                        temperature=0.0, extra_body={"return_token_ids": True})
        assert [c.index for c in out.choices] == [0, 1, 2]
        total = 0
        for prompt, choice in zip(PROMPTS, out.choices):
            want = grpc_client.generate(prompt, adapter, temperature=0.0, max_tokens=10)
            assert choice.model_extra["token_ids"] == want.token_ids, model
            assert choice.text == want.text
            assert choice.finish_reason == "length"
            total += want.usage.prompt_tokens
        assert out.usage.prompt_tokens == total
        assert out.usage.completion_tokens == 30
        assert out.usage.total_tokens == total + 30
        assert out.object == "text_completion" and out.model == model


def test_chat_sync_stream_matches_grpc(client, grpc_client, base_model):
    for model, adapter in ((base_model, None), ("a1", "a1"), ("a2", "a2")):
        want = grpc_client.chat(MESSAGES, adapter, temperature=0.0, max_tokens=12)
        chunks = list(client.chat.completions.create(
            model=model, messages=MESSAGES, max_completion_tokens=12, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"return_token_ids": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        body = [c for c in chunks if c.choices]
        ids = [t for c in body for t in (c.choices[0].model_extra.get("token_ids") or [])]
        assert ids == want.token_ids, model
        assert "".join(c.choices[0].delta.content or "" for c in body) == want.text
        assert body[-1].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert chunks[-1].usage.prompt_tokens == want.usage.prompt_tokens
        assert all(c.usage is None for c in chunks[:-1])
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_chat_uses_the_adapters_own_template(client, files, base_model):
    tok = Tokenizer.from_dir(files["model"])
    expect = {}
    for model, directory in ((base_model, files["model"]), ("a1", files["model"]),
                             ("a2", os.path.join(files["adapters"], "a2"))):
        text = ChatTemplate.from_dir(directory, {"bos_token": "<s>"}).render(MESSAGES)
        expect[model] = len(tok.encode(text, add_special_tokens=False))
    assert expect["a2"] != expect[base_model]
    for model, n in expect.items():
        out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                             temperature=0.0)
        assert out.usage.prompt_tokens == n, model


def test_async_clients_match_grpc(server, grpc_client, base_model):
    targets = ((base_model, None), ("a1", "a1"), ("a2", "a2"))
    want_chat = {m: grpc_client.chat(MESSAGES, a, temperature=0.0, max_tokens=8).token_ids
                 for m, a in targets}
    want_text = {m: _grpc_tokens(grpc_client, PROMPTS[0], a, max_tokens=8) for m, a in targets}

    async def chat(aclient, model):
        out = await aclient.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=8, temperature=0.0,
            extra_body={"return_token_ids": True})
        return out.choices[0].model_extra["token_ids"]

    async def completion_stream(aclient, model):
        ids = []
        async for chunk in await aclient.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0.0, stream=True,
                extra_body={"return_token_ids": True}):
            ids.extend(chunk.choices[0].model_extra.get("token_ids") or [])
        return ids

    async def main():
        async with openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=TOKEN,
                                      max_retries=0) as aclient:
            # all six at once: the base model and both adapters share the engine's batches
            return await asyncio.gather(*(chat(aclient, m) for m, _ in targets),
                                        *(completion_stream(aclient, m) for m, _ in targets))

    got = asyncio.run(main())
    assert got[:3] == [want_chat[m] for m, _ in targets]
    assert got[3:] == [want_text[m] for m, _ in targets]


def test_n_seed_and_logprobs(client, grpc_client):
    want = [lp.logprob for r in grpc_client.stream(PROMPTS[1], "a1", temperature=0.0,
                                                   max_tokens=6, logprobs=True, top_logprobs=3)
            for lp in r.logprobs]
    out = client.chat.completions.create(model="a1", messages=MESSAGES, max_tokens=6, n=3,
                                         temperature=1.0, seed=7)
    again = client.chat.completions.create(model="a1", messages=MESSAGES, max_tokens=6, n=3,
                                           temperature=1.0, seed=7)
    assert [c.message.content for c in out.choices] == [c.message.content for c in again.choices]
    assert len({c.message.content for c in out.choices}) > 1  # seed + index per choice
    assert out.usage.completion_tokens == 18
    assert out.usage.prompt_tokens == again.usage.prompt_tokens  # the prompt counted once
    comp = client.completions.create(model="a1", prompt=PROMPTS[1], max_tokens=6,
                                     temperature=0.0, logprobs=3)
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(top) <= 3 for top in lp.top_logprobs) and len(lp.tokens) == 6
    assert "".join(lp.tokens) == comp.choices[0].text
    chat = client.chat.completions.create(model="a1", messages=MESSAGES, max_tokens=4,
                                          temperature=0.0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5) for c in content)


def test_stop_strings(client, grpc_client):
    full = client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=16,
                                     temperature=0.0).choices[0].text
    stop = full[3:6]
    out = client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0.0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)]


def test_stream_ends_with_done(server, admin):
    status, raw = _http(server["base"], "/v1/completions",
                        {"model": "a1", "prompt": PROMPTS[0], "max_tokens": 3, "stream": True})
    assert status == 200
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


# ---- errors -------------------------------------------------------------------------

def _error(exc_info) -> dict:
    body = exc_info.value.body
    assert set(body) == {"message", "type", "param", "code"}, body
    return body


def _oversize_post(base: str, limit: int) -> tuple[int, dict]:
    """Announce a body over the limit; the answer comes before any of it is sent."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        for k, v in (("Authorization", f"Bearer {TOKEN}"), ("Content-Type", "application/json"),
                     ("Content-Length", str(limit + 1))):
            conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_error_shapes(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert _error(info)["code"] == "model_not_found" and _error(info)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="a1", prompt="x", max_tokens=2, temperature=-1)
    assert _error(info)["param"] == "temperature"
    assert _error(info)["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="a1", messages=MESSAGES, presence_penalty=0.5)
    assert _error(info)["param"] == "presence_penalty"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="a1", messages=[{"content": "no role"}])
    assert "role" in _error(info)["param"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="a1", prompt="x " * 3000, max_tokens=2)
    assert _error(info)["param"] == "prompt"
    unauthorized = openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        unauthorized.models.list()
    assert _error(info)["type"] == "authentication_error"
    status, body = _oversize_post(server["base"], 1 << 20)
    assert status == 413 and set(body["error"]) == {"message", "type", "param", "code"}
    status, body = _http(server["base"], "/v1/completions", data=b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_overload_is_429_and_others_are_undisturbed(client, server):
    streams = [client.completions.create(model="a1", prompt=PROMPTS[0], max_tokens=900,
                                         temperature=0.0, stream=True)
               for _ in range(MAX_INFLIGHT)]
    try:
        firsts = [next(iter(s)) for s in streams]  # every stream is admitted and running
        assert all(f.choices for f in firsts)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="a1", prompt="x", max_tokens=2)
        assert _error(info)["type"] == "rate_limit_error"
        assert info.value.response.headers["retry-after"] == "1"
    finally:
        for s in streams:
            s.close()
    deadline = time.monotonic() + 30
    while True:  # the aborted streams leave the admission count
        try:
            out = client.completions.create(model="a1", prompt="x", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert out.usage.completion_tokens == 2


# ---- gRPC error details and SDK retries (the same gateway) ---------------------------

def test_grpc_errors_carry_field_violations(server, grpc_client):
    cases = [(lambda: grpc_client.generate("x", "a1", temperature=-1.0), "sampling.temperature"),
             (lambda: grpc_client.generate([10**6], None), "token_ids.ids"),
             (lambda: grpc_client.chat([{"role": "", "content": "x"}], "a1"),
              "messages.messages[0].role"),
             (lambda: grpc_client.generate("x " * 3000, None), "prompt")]
    for call, field in cases:
        with pytest.raises(LoramuxError) as info:
            call()
        err = info.value
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in err.field_violations] == [field]
        assert err.field_violations[0][1] == err.details and err.retry_delay is None
    with pytest.raises(LoramuxError) as info:
        grpc_client.generate("x", "nope")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and not info.value.field_violations


def _gateway_metric(server, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(server["metrics"], timeout=30).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and s.labels == labels)


def test_overload_retry_info_and_sdk_retries(server, admin):
    """At the admission limit: RESOURCE_EXHAUSTED with RetryInfo; a client without retries
    fails at once, the SDK's retry policy tries the call again (every attempt reaches the
    gateway: its refusals are counted) until a slot frees or its attempts run out, and once
    a slot frees a call is served.

    Counted, not timed: the policy's backoff is random (gRPC draws each wait between zero
    and the current backoff), so a slot freed at a fixed time may come after the last try,
    and a stream may end on its own during the tries."""
    from loramux._channel import _BACKOFF

    def refusals() -> float:
        return _gateway_metric(server, "loramux_requests_total", adapter="",
                               status="RESOURCE_EXHAUSTED")

    with GenerateClient(server["gateway"], retry=False) as plain, \
            GenerateClient(server["gateway"]) as retrying:
        streams = [plain.stream(PROMPTS[0], "a1", max_tokens=900, ignore_eos=True)
                   for _ in range(MAX_INFLIGHT)]
        for s in streams:
            next(s)
        try:
            before = refusals()
            with pytest.raises(LoramuxError) as info:
                plain.generate("x", None, max_tokens=2)
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert info.value.retry_delay == 1.0
            assert refusals() - before == 1
            try:  # its first attempt comes while the gateway is still full
                retried = retrying.generate("x", None, max_tokens=2)
            except LoramuxError as err:
                retried = err
            attempts_refused = refusals() - before - 1
            if isinstance(retried, LoramuxError):  # every attempt was refused
                assert retried.code == grpc.StatusCode.RESOURCE_EXHAUSTED, retried
                assert attempts_refused == _BACKOFF["maxAttempts"]
            else:  # refused, retried, served
                assert 1 <= attempts_refused < _BACKOFF["maxAttempts"]
                assert len(retried.token_ids) == 2
            streams.pop().close()
            deadline = time.monotonic() + 30
            while _gateway_metric(server, "loramux_inflight_requests") >= MAX_INFLIGHT:
                assert time.monotonic() < deadline, "the closed stream kept its slot"
                time.sleep(0.05)
            out = retrying.generate("x", None, max_tokens=2)
            assert len(out.token_ids) == 2
        finally:
            for s in streams:
                s.close()


def test_overload_and_unavailability_map_to_429_and_503():
    """The mapping a dead or draining engine takes (UNAVAILABLE), next to the admission
    limit's (RESOURCE_EXHAUSTED, seen end to end above)."""
    from loramux_services.gateway.errors import Rejected
    from loramux_services.gateway.http_api import ApiError, error_response

    for code, status, kind in ((grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable_error"),
                               (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")):
        resp = error_response(ApiError.from_rejected(Rejected(code, "engine unavailable")))
        body = json.loads(resp.body)
        assert resp.status_code == status and resp.headers["retry-after"] == "1"
        assert body == {"error": {"message": "engine unavailable", "type": kind, "param": None,
                                  "code": code.name.lower()}}

"""A `loramux serve` with the HTTP API on loopback over a tiny model whose chat template
renders tools in the hermes format, with adapters a1 and a2 loaded: what the structured
output and tool-call tests run against (the gRPC and control ports are picked by the
system; the HTTP port is a free one, as 0 turns it off)."""
from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import openai
from loramux import AdminClient

from loramux_services.launcher import free_port
from tests.support.serve_process import ServeProcess
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

# renders tools, a turn's calls and tool results as Qwen2.5 / Hermes templates do
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou may call these tools:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\nAnswer a call as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n"
    "</tool_call>\n{% endfor %}{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n"
    "</tool_response>\n{% else %}{{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_files(root: Path) -> dict:
    model = make_model(root / "model", TinySpec())
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    adapters = root / "adapters"
    for i, name in enumerate(("a1", "a2"), start=1):
        make_adapter(adapters / name, model, AdapterSpec(seed=60 + i))
    return {"root": root, "model": str(model), "adapters": str(adapters)}


@contextlib.contextmanager
def serving(files: dict, *extra: str):
    """Yields the ServeProcess, its `http` base URL set, a1 and a2 loaded."""
    http_port = free_port()
    serve = ServeProcess(files["root"] / f"run-{http_port}", "--model", files["model"],
                         "--adapter-root", files["adapters"], "--device", "cpu",
                         "--gateway-port", "0", "--control-port", "0", "--metrics-port", "-1",
                         "--http-port", str(http_port), *extra)
    try:
        serve.wait_serving()
        serve.http = "http://" + re.search(r"^\s+http\s+(\S+)", serve.stderr, re.M).group(1)
        with AdminClient(serve.control) as admin:
            admin.load("a1", "a1")
            admin.load("a2", "a2")
        _wait_models(serve.http, {"a1", "a2"})
        yield serve
    finally:
        serve.stop()


def _wait_models(base: str, want: set[str], timeout_s: float = 60.0) -> None:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + timeout_s
    while not want <= {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, "the adapters did not show in /v1/models"
        time.sleep(0.1)

"""benchmarks/bench_structured.py: its whole flow on the CPU with a 2-layer toy model and a
small trained tokenizer through the decode suite (`python -m benchmarks.decode structured
--tiny`; the real run needs a GPU and the Llama-3-8B shape)."""
from __future__ import annotations

import json

import pytest

from benchmarks import decode, suite
from benchmarks.structured_schemas import SCHEMAS


@pytest.mark.engine_device("cpu")  # the device its --device names, whatever the suite's
def test_whole_flow_on_the_cpu(tmp_path, capsys):
    rc = suite.main("decode", decode.CASES, ["structured", "--out", str(tmp_path), "--tiny",
                                             "--batch", "4", "--steps", "3", "--repeats", "2"])
    assert rc == 0
    record = json.loads((tmp_path / "run-decode-structured.json").read_text())
    assert (record["rc"], record["files"]) == (0, ["structured.json"])
    result = json.loads((tmp_path / "structured.json").read_text())
    rows = result["decode"]
    assert [(r["fraction"], r["constrained"]) for r in rows] == [(0.0, 0), (0.25, 1), (1.0, 4)]
    assert all(r["constrained_at_end"] == r["constrained"] and r["step_ms"] > 0 for r in rows)
    assert rows[0]["fill_ms"] == 0 and rows[2]["fill_ms"] > 0
    c = result["compile"]
    assert set(c["per_schema_p50_ms"]) == set(SCHEMAS) and 0 < c["p50_ms"] <= c["p99_ms"]
    assert "| 100% | 4 |" in capsys.readouterr().out

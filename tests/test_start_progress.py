"""services/start_progress.py: `loramux serve` shows the engines' start-up progress lines
(and only those) from their logs while it waits, each under its process's name, a line
only once it is whole, from where each log ended when the wait began."""
import io

from loramux_services.start_progress import StartProgress


def test_progress_lines_of_each_engine_log_are_echoed_once(tmp_path):
    logs = {name: tmp_path / f"{name}.log" for name in ("engine-0", "engine-1")}
    logs["engine-0"].write_text("engine warm-up: an earlier start's line\n")
    out = io.StringIO()
    with StartProgress(logs, stream=out, period_s=60) as progress:  # echoes on demand
        with open(logs["engine-0"], "a") as f:
            f.write("torch says something\nengine loading: loading weights, sizing the KV cache\n"
                    "engine warm-up: capturing decode graph 30/56, 54% of warm-up, about 21 s")
        logs["engine-1"].write_text("engine parallel compile: 90 kernel variants listed\n")
        progress._echo()
        with open(logs["engine-0"], "a") as f:
            f.write(" left\nengine warm-up 17.3 s: 1906 eager step shapes\n"
                    "engine serving: input=tcp://...\n")
    assert out.getvalue().splitlines() == [
        "engine-0: engine loading: loading weights, sizing the KV cache",
        "engine-1: engine parallel compile: 90 kernel variants listed",
        "engine-0: engine warm-up: capturing decode graph 30/56, 54% of warm-up, about 21 s left",
        "engine-0: engine warm-up 17.3 s: 1906 eager step shapes"]

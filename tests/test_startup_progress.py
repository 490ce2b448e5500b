"""engine/startup.py: the phase, progress and estimate the heartbeats carry, the seconds
each phase took, and the stderr line that shows them every few seconds or 10%."""
import io

from loramux_engine.startup import ProgressLine, StartupProgress, progress_text
from loramux_core.v1 import engine_pb2

LOADING, WARMING, SERVING = (engine_pb2.ENGINE_PHASE_LOADING,
                             engine_pb2.ENGINE_PHASE_WARMING_UP,
                             engine_pb2.ENGINE_PHASE_SERVING)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_estimate_follows_the_rate_so_far_and_phases_are_timed():
    clock = Clock()
    progress = StartupProgress(clock=clock)
    progress.enter(LOADING, "loading weights")
    assert progress.snapshot().eta_s < 0           # no rate yet: unknown
    clock.now += 8
    progress.enter(WARMING, "starting")
    clock.now += 10
    progress.advance("capturing decode graph 5/20", 0.25)
    snap = progress.snapshot()
    assert (snap.phase, snap.detail, snap.progress) == (WARMING, "capturing decode graph 5/20", 0.25)
    assert snap.eta_s == 30.0 and snap.updated == clock.now   # 10 s for a quarter
    clock.now += 30
    progress.enter(SERVING, "serving")
    assert progress.seconds == {"loading": 8.0, "warm-up": 40.0}
    assert progress_text(snap) == ("engine warm-up: capturing decode graph 5/20, "
                                   "25% of warm-up, about 30 s left")


def test_the_line_comes_every_few_seconds_or_ten_percent():
    clock, out = Clock(), io.StringIO()
    progress = StartupProgress(on_update=ProgressLine(out, every_s=5.0, clock=clock),
                               clock=clock)
    progress.enter(WARMING, "starting")                      # a new phase: a line
    for i in range(1, 100):                                  # 1% per 0.1 s
        clock.now += 0.1
        progress.advance(f"compiling eager step {i}/100", i / 100)
    progress.enter(SERVING, "serving")                       # the server says it itself
    lines = out.getvalue().splitlines()
    assert lines[0] == "engine warm-up: starting"
    assert [line.split(",")[0] for line in lines[1:]] == [
        f"engine warm-up: compiling eager step {i}/100" for i in range(10, 100, 10)]

"""Host -> slot copies, ordered by events instead of host syncs.

    compute stream:  ─ step N (reads s') ─┬─ step N+1 ──── wait(e) ── step N+2 (reads s)
    side stream:            copy → s, record e   (waits only for the last step that read s)

A copy into slot s is queued on a side stream at once, ordered after the last launched
step that read s (`note_reads`: one event per step, recorded after its launch) and after
the earlier copies (one stream, in order), and after nothing else: it does not wait for
the steps in flight that read other slots, so it overlaps them. A copy that waited for all
the queued compute would start only when the step in flight ends, beside the next step's
input uploads, which then queue behind its megabytes on the host-to-device copy engine;
issued while a step runs, it lands during that step. The step that first reads s makes the
compute stream wait for the copy's event (`order_compute_after`): the host never blocks,
the step is queued at once, and the device runs it when the copy has landed.

Whoever launches work that reads slots must `note_reads` them right after queueing it;
reads not noted are not waited for (the residency manager's eviction rules already keep
copies off the slots of running adapters; the noted reads also cover a request preempted
while a step in flight still reads its slot).

`StreamCopier` is that on CUDA; `InlineCopier` copies at once (the CPU: nothing runs
concurrently). Tests substitute a copier that defers and poisons (tests/support/).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import torch


class InlineCopier:
    """Copies run when queued; nothing is ever pending."""

    def queue(self, slot: int, adapter_id: int, copy: Callable[[], None]):
        copy()
        return None

    def note_reads(self, slots: Iterable[int]) -> None:
        pass

    def done(self, handle) -> bool:
        return True

    def order_compute_after(self, handle) -> None:
        pass

    def wait(self, handle) -> None:
        pass


class StreamCopier:
    """Copies on a side CUDA stream; a handle is the event recorded after the copy."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self._last_read: dict[int, torch.cuda.Event] = {}  # slot -> after its last reader

    def note_reads(self, slots: Iterable[int]) -> None:
        """The work just queued on the compute stream reads `slots`: a later copy into one
        of them waits for it (one event for all of them)."""
        slots = [s for s in slots if s >= 0]
        if not slots:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.stream.device))
        for slot in slots:
            self._last_read[slot] = event

    def queue(self, slot: int, adapter_id: int, copy: Callable[[], None]):
        """Run `copy` (which writes `adapter_id` into `slot`) on the side stream, after the
        slot's last noted reader; returns the copy's event."""
        last = self._last_read.pop(slot, None)
        if last is not None:
            self.stream.wait_event(last)
        with torch.cuda.stream(self.stream):
            copy()
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def done(self, handle) -> bool:
        return handle.query()

    def order_compute_after(self, handle) -> None:
        torch.cuda.current_stream(self.stream.device).wait_event(handle)

    def wait(self, handle) -> None:
        handle.synchronize()


def copier_for(device: torch.device):
    return StreamCopier(device) if device.type == "cuda" else InlineCopier()

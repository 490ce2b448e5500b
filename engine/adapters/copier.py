"""Host -> slot copies, ordered by events instead of host syncs.

    compute stream:  ... step N-1 ─────────── step N ──── wait(e) ── step N+1 (reads slot s)
    side stream:              └wait┘ copy → s, record e

A copy into slot s is queued on a side stream after all work already queued on the
compute stream (so it never overwrites s while an earlier step may still read it), and
records an event. The step that first reads s makes the compute stream wait for that
event (`order_compute_after`): the host never blocks, the step is queued at once, and
the device runs it when the copy has landed. The copy overlaps whatever the compute
stream runs meanwhile.

`StreamCopier` is that on CUDA; `InlineCopier` copies at once (the CPU: nothing runs
concurrently). Tests substitute a copier that defers and poisons (tests/support/).
"""
from __future__ import annotations

from typing import Callable

import torch


class InlineCopier:
    """Copies run when queued; nothing is ever pending."""

    def queue(self, slot: int, adapter_id: int, copy: Callable[[], None]):
        copy()
        return None

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

    def queue(self, slot: int, adapter_id: int, copy: Callable[[], None]):
        """Run `copy` (which writes `adapter_id` into `slot`) on the side stream; returns
        its event."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
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

"""A pytest plugin for a GPU check of the graph-capture race fixed in engine/cuda_graph.py
(DecodeStaging.fill_padding waits for the last upload): every graph-input upload is queued
behind about 0.1 s of GPU sleep, so a step's input copies always run late, after the host
has gone on to the next step. With LORAMUX_OLD_CAPTURE=1 the padding of a capture does not
wait (the behaviour before the fix), and the graph tests should then fail.

    LORAMUX_TEST_DEVICE=cuda python3 -m pytest -p tests.support.late_upload \\
        tests/test_cuda_graphs.py tests/test_engine_parity.py tests/test_moe_parity.py \\
        -k "graph_replay_matches_eager_and_hf or triton_greedy_pick_in_the_graph or fewer_slots or mixed_batch_matches_peft"
"""
from __future__ import annotations

import os

import torch


def pytest_configure(config):
    from loramux_engine import cuda_graph

    upload = cuda_graph.DecodeStaging.upload

    def late(self):
        if self._uploaded is not None:          # CUDA only
            torch.cuda._sleep(int(2e8))        # GPU cycles, about 0.1 s
        upload(self)

    cuda_graph.DecodeStaging.upload = late
    if os.environ.get("LORAMUX_OLD_CAPTURE") == "1":
        cuda_graph.DecodeStaging.fill_padding = cuda_graph.DecodeStaging._pad

"""CUDA-graph runner logic that needs no GPU: bucket choice, decode-step detection, the
static decode buffers (filled on the CPU here) against the eager metadata builder, and
their host mirror left alone until a queued upload has read it (a device that defers)."""
import pytest
import torch

from loramux_engine.cuda_graph import DecodeStaging, bucket_for, decode_buckets, is_decode_step
from loramux_engine.model.batch import make_attention_metadata
from loramux_engine.request import Request
from loramux_engine.scheduler import ScheduledRequest
from loramux_core.sampling import SamplingParams


def test_buckets_powers_of_two_then_max():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(8) == (1, 2, 4, 8)
    assert decode_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert decode_buckets(256)[-3:] == (64, 128, 256)


@pytest.mark.parametrize("n,want", [(1, 1), (3, 4), (4, 4), (5, 8), (33, 48), (48, 48), (49, None)])
def test_bucket_for(n, want):
    assert bucket_for(decode_buckets(48), n) == want


def _sched(rid, tokens, start, new, blocks, slot, samples=True):
    req = Request(rid, tokens, SamplingParams())
    return ScheduledRequest(req, start, new, tuple(blocks), slot, samples)


def test_decode_step_detection():
    dec = [_sched("a", [5, 6, 7], 2, 1, [3], 0), _sched("b", [1, 2], 1, 1, [4], -1)]
    assert is_decode_step(dec)
    assert not is_decode_step([])
    assert not is_decode_step(dec + [_sched("c", [1, 2, 3], 0, 3, [5], -1)])


def test_staging_matches_eager_metadata_and_pads():
    bs, max_len = 4, 64
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i, (length, slot) in enumerate([(9, 1), (1, -1), (16, 0), (30, 2), (5, -1)]):
        tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
        blocks = torch.randperm(200, generator=gen)[:-(-length // bs)].tolist()
        rows.append(_sched(f"r{i}", tokens, length - 1, 1, blocks, slot))
    st = DecodeStaging(max_batch=16, max_blocks=max_len // bs, block_size=bs,
                       max_model_len=max_len, device=torch.device("cpu"))
    st.fill_padding(0, 16)
    st._n64[:] = 77      # stale values from an earlier, larger step must be overwritten
    st._n32[:] = 77
    st.fill(rows, bucket=8)
    st.upload()
    ids, attn, slots = st.views(8)
    ref = make_attention_metadata([list(s.block_ids) for s in rows], [s.start for s in rows],
                                  [1] * len(rows), bs)
    n = len(rows)
    assert ids[:n].tolist() == [s.request.all_token_ids[s.start] for s in rows]
    assert torch.equal(attn.positions[:n], ref.positions)
    assert torch.equal(attn.slot_mapping[:n], ref.slot_mapping)
    assert torch.equal(attn.seq_lens[:n], ref.seq_lens)
    assert torch.equal(attn.query_start_loc, torch.arange(9, dtype=torch.int32))
    width = ref.block_tables.shape[1]
    for i, s in enumerate(rows):  # entries past a sequence's blocks are never read
        nb = len(s.block_ids)
        assert attn.block_tables[i, :nb].tolist() == ref.block_tables[i, :nb].tolist()
    assert attn.block_tables.shape == (8, max_len // bs) and width <= max_len // bs
    assert slots[:n].tolist() == [s.slot for s in rows]
    # padding rows: token 0 at position 0, KV write skipped, no adapter, block 0
    assert ids[n:].tolist() == [0] * 3 and attn.positions[n:].tolist() == [0] * 3
    assert attn.slot_mapping[n:].tolist() == [-1] * 3 and attn.seq_lens[n:].tolist() == [1] * 3
    assert slots[n:].tolist() == [-1] * 3 and attn.block_tables[n:].abs().sum() == 0
    assert (attn.max_query_len, attn.max_seq_len, attn.num_tokens) == (1, max_len, 8)


def test_staging_runs_the_model_like_eager(llama_family):
    """The model on the staging buffers (CPU, padded bucket) gives the eager hidden
    states for the real rows: padding rows neither write KV nor disturb real ones."""
    from loramux_core.model.hf_config import ModelConfig
    from loramux_engine.model.llama import LlamaForCausalLM

    cfg = ModelConfig.from_dir(llama_family.model_dir)
    model = LlamaForCausalLM(cfg)
    model.load_weights(llama_family.model_dir)
    bs, max_len = 4, 64
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, length in enumerate([6, 12, 3]):
        tokens = torch.randint(3, 300, (length,), generator=gen).tolist()
        rows.append(_sched(f"r{i}", tokens, length - 1, 1, [3 * i, 3 * i + 1, 3 * i + 2][:-(-length // bs)], -1))
    kv_a = model.make_kv_caches(16, bs)
    for k, v in kv_a:   # a random cache: every context token is "already computed"
        k.normal_(generator=gen)
        v.normal_(generator=gen)
    kv_b = [(k.clone(), v.clone()) for k, v in kv_a]
    ref_attn = make_attention_metadata([list(s.block_ids) for s in rows],
                                       [s.start for s in rows], [1] * 3, bs)
    ids = torch.tensor([s.request.all_token_ids[s.start] for s in rows])
    want = model.forward(ids, ref_attn, kv_a)
    st = DecodeStaging(8, max_len // bs, bs, max_len, torch.device("cpu"))
    st.fill(rows, bucket=4)
    st.upload()
    sids, sattn, _ = st.views(4)
    got = model.forward(sids, sattn, kv_b)
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=1e-5)
    for (ka, va), (kb, vb) in zip(kv_a, kv_b):  # a padding write would be far off
        torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)


def test_greedy_pick_equals_the_sampler_on_greedy_rows():
    """The in-graph pick (argmax + raw logprob) gives the Sampler's token and logprob."""
    from loramux_kernels.greedy_pick import greedy_pick
    from loramux_engine.sampling import Sampler, SamplingState
    from loramux_core.sampling import SamplingParams

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 97, generator=gen) * 4).bfloat16()
    states = [SamplingState.create(SamplingParams(temperature=0.0), [1, 2], default_seed=0,
                                   sample_index=0) for _ in range(5)]
    want = Sampler().sample(logits, states)
    tok, lp = greedy_pick(logits).tolist()
    assert [int(t) for t in tok] == want.token_ids
    assert lp == want.logprobs


def test_staging_refill_keeps_rows_right_when_tables_move_or_grow():
    """fill() skips rewriting a row that holds the same block-id tuple as last step; rows
    whose request moved, whose table grew, or that were padded must be rewritten."""
    bs, max_len = 4, 64
    gen = torch.Generator().manual_seed(1)
    rows = []
    for i, length in enumerate([9, 13, 5, 20]):
        tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
        blocks = tuple(torch.randperm(200, generator=gen)[:-(-length // bs)].tolist())
        rows.append(_sched(f"r{i}", tokens, length - 1, 1, blocks, -1))
    st = DecodeStaging(max_batch=8, max_blocks=max_len // bs, block_size=bs,
                       max_model_len=max_len, device=torch.device("cpu"))
    st.fill(rows, bucket=4)
    grown = rows[0].block_ids + (199,)
    rows[0] = _sched("r0", rows[0].request.all_token_ids, 8, 1, grown, -1)
    for order in ([rows[0], rows[1], rows[2], rows[3]], [rows[3], rows[1], rows[0], rows[2]]):
        st.fill(order, bucket=4)
        st.upload()
        _, attn, _ = st.views(4)
        for i, s in enumerate(order):
            assert attn.block_tables[i, :len(s.block_ids)].tolist() == list(s.block_ids)
    st.fill(rows, bucket=4)
    st.fill(rows[:2], bucket=4)   # rows 2, 3 padded (zeroed), then refilled as before
    st.fill(rows, bucket=4)
    st.upload()
    _, attn, _ = st.views(4)
    for i, s in enumerate(rows):
        assert attn.block_tables[i, :len(s.block_ids)].tolist() == list(s.block_ids)


class _DeferredDevice:
    """The slowest legal device: what the host queues on it (the staging's uploads, graph
    replays) runs only when the host waits for it."""

    def __init__(self):
        self.queue: list = []

    def run(self) -> None:
        while self.queue:
            self.queue.pop(0)()


class _DeferredStaging(DecodeStaging):
    """Uploads as a GPU runs them: the copies read the host mirror when the device gets
    to them, and the `_uploaded` event is the host's wait for that."""

    def __init__(self, device: _DeferredDevice, *args):
        super().__init__(*args)
        self.device = device
        self._uploaded = type("Uploaded", (), {"synchronize": staticmethod(device.run),
                                               "record": staticmethod(lambda: None)})()

    def upload(self) -> None:
        self.device.queue.append(lambda: (self.d64.copy_(self.h64), self.d32.copy_(self.h32)))


class _EchoModel:
    def forward(self, ids, attn, kv_caches, lora):
        return ids[:, None].float()


def test_capture_waits_for_the_replay_in_flight_to_read_its_inputs(monkeypatch):
    """A decode step replays its graph (inputs uploaded from the host mirror, queued behind
    the step in flight); the next step needs a graph not captured yet (fewer rows: a smaller
    bucket), and its capture pads the mirror for the capture's own inputs. The queued
    upload must have read the mirror before: else the step in flight runs on padding
    (token 0 at position 0, no KV write, no adapter) in the rows the capture padded."""
    from loramux_engine.cuda_graph import CudaGraphRunner
    from tests.support import fake_cuda

    cuda = fake_cuda.install(monkeypatch)
    device = _DeferredDevice()
    seen: list[torch.Tensor] = []   # each replay's input ids, positions, slot mapping

    class Graph:
        def replay(self):
            device.queue.append(lambda: seen.append(runner.staging.d64.clone()))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device.run())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: cuda.use(cuda.new_stream()))
    bs, max_len = 4, 64
    runner = CudaGraphRunner(_EchoModel(), None, None, bs, 8, max_len, torch.device("cpu"))
    runner.staging = _DeferredStaging(device, 8, max_len // bs, bs, max_len,
                                      torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    rows = []
    for i, length in enumerate([7, 3, 12, 9, 5]):
        tokens = torch.randint(3, 500, (length,), generator=gen).tolist()
        rows.append(_sched(f"r{i}", tokens, length - 1, 1, range(4 * i, 4 * i + 4), -1))
    steps = [rows, rows[:3]]                        # buckets 8, then 4: a new graph
    for sched in steps:
        runner.run(sched, runner.key_for(sched, greedy=False))
    device.run()
    assert len(seen) == 2 and runner.num_replays == 2
    for sched, d64 in zip(steps, seen):
        n = len(sched)
        assert d64[0, :n].tolist() == [s.request.all_token_ids[s.start] for s in sched]
        assert d64[1, :n].tolist() == [s.start for s in sched]
        assert d64[2, :n].tolist() == [s.block_ids[s.start // bs] * bs + s.start % bs
                                       for s in sched]

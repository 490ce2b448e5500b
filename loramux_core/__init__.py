"""loramux_core: the contract every loramux process shares, and nothing that needs torch.

- `loramux_core.v1.engine_pb2`: the internal engine protocol over ZMQ (generated from
  protos/loramux_core/v1; the public API's messages stay in the client SDK, `loramux.v1`):
  requests, adapter commands and acks, step batches, heartbeats, and the periodic
  `EngineEvent` with its typed `EngineCounters`;
- `sampling`: SamplingParams, as the engine takes them, and their wire conversion;
- `errors`: the typed error hierarchy and the gRPC status code each maps to;
- `safe_files` (with `file_digest`): reading adapter files inside the adapter roots, and
  the version hash the control plane and the engines agree on;
- `tokenizer`: text <-> token ids (the gateway encodes, the engine decodes);
- `curve`: the CURVE keys that guard the engine's ZMQ sockets;
- `probe`: waiting for an engine's output socket (launcher, health checks);
- `engine_config`: the engine's configuration as plain values (EngineSettings) and the
  rules it is checked by, which `loramux serve` applies before any process starts;
- `model`: the model registry (one module per architecture: config fields, LoRA targets),
  config.json read into a ModelConfig, the LoRA targets' shapes and tensor-parallel split;
- `adapter`: a PEFT adapter's config, safetensors header and plan, checked against the
  model (the control plane's validator; the engine loads from the same plan);
- `options`: command-line option tables (the engine's flags, which `loramux serve`
  forwards) and their parsing helpers;
- `open_audit`: a test-only audit of the files a process opens.

Arrows point here, never out: it imports no other loramux package but the SDK's public
protos (tests/test_layering.py).
"""

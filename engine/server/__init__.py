"""The engine's process entry point: runs the Engine loop behind ZMQ sockets.

Wire contract (protobuf only, `loramux.v1` engine.proto):
- input, a PULL socket the engine binds: one `EngineInput` per message (generate, abort,
  adapter command) from any number of gateways and control planes (they PUSH);
- output, a PUB socket the engine binds: one `EngineOutput` per message: a `StepBatch` per
  engine step holding every request's new tokens, `AdapterAck`s, periodic `EngineEvent`s
  (residency, in-flight counts, evictions) and `Heartbeat`s carrying a per-process
  instance id (a new id = the engine restarted).

Only holders of the run's CURVE keys can connect (loramux_core/curve.py).

Run: `python -m loramux_engine.server --model DIR --input tcp://127.0.0.1:5555 --output
tcp://127.0.0.1:5556 --zmq-keys KEYDIR`.
"""

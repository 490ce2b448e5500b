"""A local process that tries to use a running service's ZMQ sockets, as an attacker on the
same host would: `python -m tests.support.rogue_zmq --as plain|stranger|member ...`.

For `--seconds` it keeps pushing to the engine's input: a pinned load of an adapter from
outside the adapter roots, a pin and an unload of a served adapter, a generate request and
garbage bytes; and it listens on the engine's output and the control plane's adapter
table. It prints one JSON line: what it received.

- plain: no CURVE at all;
- stranger: CURVE with a key pair of its own and the service's real server public key
  (the worst case: the public key leaked);
- member: the run's own client keys (the positive control: what the checks would see if
  the sockets were open). A member sends only a pin of an adapter that does not exist,
  and stops early once it has seen engine output, a table and its pin's ack."""
from __future__ import annotations

import argparse
import json
import time

import zmq
from loramux.v1 import generate_pb2

from loramux_core.curve import ZmqKeys
from loramux_core.v1 import engine_pb2


_Kind = engine_pb2.AdapterCommandKind


def attacks(outside_path: str, served: str) -> list[bytes]:
    cmd = engine_pb2.AdapterCommand
    msgs = [
        engine_pb2.EngineInput(adapter_command=cmd(
            command_id="rogue-load", kind=_Kind.ADAPTER_COMMAND_KIND_LOAD, name="rogue",
            path=outside_path, pinned=True)),
        engine_pb2.EngineInput(adapter_command=cmd(
            command_id="rogue-pin", kind=_Kind.ADAPTER_COMMAND_KIND_PIN, name=served)),
        engine_pb2.EngineInput(adapter_command=cmd(
            command_id="rogue-unload", kind=_Kind.ADAPTER_COMMAND_KIND_UNLOAD, name=served)),
        engine_pb2.EngineInput(generate=engine_pb2.EngineGenerate(
            request_id="rogue-gen", prompt_token_ids=[5, 6, 7], adapter=served,
            sampling=generate_pb2.SamplingParams(max_tokens=4))),
    ]
    return [m.SerializeToString() for m in msgs] + [b"\xff" * 64]


def harmless() -> list[bytes]:
    return [engine_pb2.EngineInput(adapter_command=engine_pb2.AdapterCommand(
        command_id="member-pin", kind=_Kind.ADAPTER_COMMAND_KIND_PIN,
        name="no-such-adapter")).SerializeToString()]


def identity(args) -> ZmqKeys | None:
    if args.mode == "plain":
        return None
    if args.mode == "member":
        return ZmqKeys.load(args.zmq_keys)
    public, secret = zmq.curve_keypair()
    return ZmqKeys("", args.server_public.encode(), b"", public, secret)


def run(args) -> dict:
    me = identity(args)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    subs = {"output": ctx.socket(zmq.SUB), "table": ctx.socket(zmq.SUB)}
    for sock in (push, *subs.values()):
        sock.setsockopt(zmq.LINGER, 0)
        if me is not None:
            me.connect(sock)
    for sock in subs.values():
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    push.connect(args.engine_input)
    subs["output"].connect(args.engine_output)
    subs["table"].connect(args.table)
    payload = harmless() if args.mode == "member" else attacks(args.outside, args.served)
    got = {"output": 0, "table": 0, "acks": [], "sent": 0}
    poller = zmq.Poller()
    for sock in subs.values():
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + args.seconds
    def seen_all() -> bool:  # what a member's run checks for
        return bool(got["output"] and got["table"] and "member-pin" in got["acks"])
    while time.monotonic() < deadline and not (args.mode == "member" and seen_all()):
        for raw in payload:
            try:
                push.send(raw, zmq.NOBLOCK)
                got["sent"] += 1
            except zmq.Again:
                pass
        for sock, _ in poller.poll(100):
            name = "output" if sock is subs["output"] else "table"
            raw = sock.recv()
            got[name] += 1
            if name == "output":
                msg = engine_pb2.EngineOutput.FromString(raw)
                if msg.WhichOneof("kind") == "adapter_ack":
                    got["acks"].append(msg.adapter_ack.command_id)
    ctx.destroy(0)
    return got


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--as", dest="mode", choices=("plain", "stranger", "member"), required=True)
    p.add_argument("--engine-input", required=True)
    p.add_argument("--engine-output", required=True)
    p.add_argument("--table", required=True)
    p.add_argument("--server-public", default="", help="the service's server public key (z85)")
    p.add_argument("--zmq-keys", default="", help="the run's key directory (member only)")
    p.add_argument("--outside", default="/")
    p.add_argument("--served", default="a1")
    p.add_argument("--seconds", type=float, default=2.0)
    print(json.dumps(run(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()

"""The `loramux` command line: generate, adapters ..., serve.

`generate` and `adapters` need only grpcio + protobuf; `serve` needs the server package
(the repository's `loramux` distribution, with torch)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from google.protobuf.json_format import MessageToDict

from loramux import tls

DEFAULT_GATEWAY = "localhost:50051"
DEFAULT_CONTROL = "localhost:50052"
_INT32 = 2**31


def _int_in(lo: int, hi: int, what: str):
    """An argparse type: an integer in [lo, hi) (argparse names the flag on error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value < hi:
            raise argparse.ArgumentTypeError(f"{value} is out of range: {what}")
        return value
    return parse


def _float_in(lo: float, hi: float, what: str, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not ((lo < value) if lo_open else (lo <= value)) or not value <= hi:
            raise argparse.ArgumentTypeError(f"{value:g} is out of range: {what}")
        return value
    return parse


class _Parser(argparse.ArgumentParser):
    """Errors in one line naming the flag (no usage block); --help shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _control_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--control", default=os.environ.get("LORAMUX_CONTROL", DEFAULT_CONTROL))
    p.add_argument("--token", default=os.environ.get("LORAMUX_ADMIN_TOKEN"),
                   help="bearer token (default: $LORAMUX_ADMIN_TOKEN)")
    tls.add_arguments(p)


def _control_arguments_again() -> argparse.ArgumentParser:
    """The same options for the actions of `adapters`, so they may also follow the action
    (`loramux adapters list --control HOST:PORT`); given there, they win; not given, they
    leave what came before the action (its defaults included) as it is."""
    again = argparse.ArgumentParser(add_help=False)
    _control_arguments(again)
    for action in again._actions:
        action.default = argparse.SUPPRESS
    return again


def _text_file(path: str) -> str:
    """An argparse type: the UTF-8 text of a file ('-': standard input)."""
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {err}") from None


def _constraint_arguments(g: argparse.ArgumentParser) -> None:
    """At most one constraint on the output (the gateway checks its content)."""
    c = g.add_mutually_exclusive_group()
    c.add_argument("--json-schema", type=_text_file, metavar="FILE",
                   help="the output is JSON valid under this JSON schema")
    c.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    c.add_argument("--regex", help="the whole output matches this regular expression")
    c.add_argument("--choice", action="append", help="the output is one of these strings "
                   "(repeat the flag for each)")
    c.add_argument("--grammar", type=_text_file, metavar="FILE",
                   help="the output follows this grammar (Lark syntax, start rule `start`)")


def constraint_kwargs(args) -> dict:
    """The SDK's constraint argument the flags give ({} for none)."""
    for name in ("json_schema", "regex", "choice", "grammar"):
        if getattr(args, name) is not None:
            return {name: getattr(args, name)}
    return {"json_object": True} if args.json_object else {}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="loramux", description="loramux client and launcher")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="stream a generation from the gateway")
    g.add_argument("prompt")
    g.add_argument("--gateway", default=os.environ.get("LORAMUX_GATEWAY", DEFAULT_GATEWAY))
    g.add_argument("--adapter", default="", help="adapter name (default: the base model)")
    g.add_argument("--max-tokens", type=_int_in(1, _INT32, "must be >= 1"), default=64)
    g.add_argument("--temperature", type=_float_in(0.0, 100.0, "must be in [0, 100]"),
                   default=0.0)
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, "must be in (0, 1]", lo_open=True))
    g.add_argument("--top-k", type=_int_in(0, _INT32, "must be >= 0 (0 disables it)"))
    g.add_argument("--seed", type=_int_in(0, 2**63, "must be in [0, 2**63)"))
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--timeout", type=_float_in(0.0, float("inf"), "must be > 0", lo_open=True),
                   default=None, help="deadline in seconds")
    _constraint_arguments(g)
    tls.add_arguments(g)

    a = sub.add_parser("adapters", help="manage adapters on the control plane")
    _control_arguments(a)
    asub = a.add_subparsers(dest="action", required=True)
    again = [_control_arguments_again()]
    reg = asub.add_parser("register", parents=again)
    reg.add_argument("name")
    reg.add_argument("path")
    load = asub.add_parser("load", parents=again)
    load.add_argument("name")
    load.add_argument("--path", default=None, help="register from this path first")
    load.add_argument("--pinned", action=argparse.BooleanOptionalAction, default=None,
                      help="pin (--pinned) or unpin (--no-pinned); default: keep the pin")
    load.add_argument("--replica", type=int, action="append", dest="replicas", default=None,
                      help="engine replica (index) to place it on, repeatable; default: every "
                           "replica (or the placement it has)")
    many = asub.add_parser("load-many", help="load many adapters in one LoadAdapters call",
                           parents=again)
    many.add_argument("file", help="lines of `name path` ('-': standard input); each "
                      "adapter gets its own status, one refused fails no other")
    for action in ("unload", "unregister", "pin", "unpin", "get"):
        asub.add_parser(action, parents=again).add_argument("name")
    lst = asub.add_parser("list", parents=again)
    lst.add_argument("--page-size", type=_int_in(0, _INT32, "must be >= 0"), default=0)

    st = sub.add_parser("status", help="each engine replica's state, from the control plane")
    _control_arguments(st)
    st.add_argument("--json", action="store_true", help="every field, as JSON")

    s = sub.add_parser("serve", help="run control plane, engine and gateway on this machine",
                       add_help=False)
    s.add_argument("serve_args", nargs=argparse.REMAINDER)
    return p


def _adapter_json(adapter) -> dict:
    return MessageToDict(adapter, always_print_fields_with_no_presence=True,
                         preserving_proto_field_name=True)


def run_generate(args) -> int:
    from loramux.client import GenerateClient

    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                    **constraint_kwargs(args))
    with GenerateClient(args.gateway, tls=tls.from_args(args)) as client:
        finish = None
        for resp in client.stream(args.prompt, args.adapter or None, timeout=args.timeout,
                                  **sampling):
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                finish = resp
    sys.stdout.write("\n")
    if finish is not None:
        from loramux.v1 import generate_pb2
        reason = generate_pb2.FinishReason.Name(finish.finish_reason)
        print(f"[{reason.removeprefix('FINISH_REASON_').lower()}: "
              f"{finish.usage.prompt_tokens} prompt + {finish.usage.completion_tokens} "
              f"completion tokens]", file=sys.stderr)
    return 0


def run_adapters(args) -> int:
    from loramux.client import AdminClient

    with AdminClient(args.control, token=args.token, tls=tls.from_args(args)) as admin:
        act = args.action
        if act == "register":
            out = _adapter_json(admin.register(args.name, args.path))
        elif act == "load":
            out = _adapter_json(admin.load(args.name, args.path, pinned=args.pinned, replicas=args.replicas))
        elif act == "load-many":
            results = admin.load_many(_load_items(args.file))
            print(json.dumps([{"name": r.name, "code": r.code.name, "message": r.message}
                              for r in results], indent=2))
            return 0 if all(r.code.name == "OK" for r in results) else 1
        elif act == "unregister":
            admin.unregister(args.name)
            out = {"unregistered": args.name}
        elif act == "list":
            out = [_adapter_json(x) for x in admin.list(args.page_size)]
        else:  # unload, pin, unpin, get
            out = _adapter_json(getattr(admin, act)(args.name))
    print(json.dumps(out, indent=2))
    return 0


def run_status(args) -> int:
    """One line per replica ("replica 1  restarting  no heartbeat for 2 s  restarts 1"),
    or every field as JSON."""
    from loramux.client import AdminClient
    from loramux.v1 import adapter_admin_pb2 as admin_pb2

    with AdminClient(args.control, token=args.token, tls=tls.from_args(args)) as admin:
        replicas = admin.status()
    if args.json:
        print(json.dumps([_adapter_json(r) for r in replicas], indent=2))
        return 0
    for r in replicas:
        state = admin_pb2.ReplicaState.Name(r.state).removeprefix("REPLICA_STATE_").lower()
        progress = f"  {r.progress:.0%}" if r.state == admin_pb2.REPLICA_STATE_WARMING_UP else ""
        detail = f"  {r.detail}" if r.detail else ""
        print(f"replica {r.replica}  {state}{progress}{detail}  restarts {r.restarts}")
    return 0


def _load_items(file: str) -> list[tuple[str, str]]:
    """(name, path) of each non-empty line `name path` of `file` ('-': stdin)."""
    text = sys.stdin.read() if file == "-" else open(file, encoding="utf-8").read()
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            parts = line.split(None, 1)
            if len(parts) != 2:
                raise SystemExit(f"error: {file}:{number}: expected `name path`")
            items.append((parts[0], parts[1].strip()))
    return items


SERVE_MODULE = "loramux_services.serve"  # the server package's launcher, run as `python -m`


def run_serve(serve_args: list[str]) -> int:
    """`loramux serve` is the server package's launcher: it replaces this process (same
    pid, so signals reach it), and the SDK imports none of the server's code."""
    import importlib.util

    try:
        found = importlib.util.find_spec(SERVE_MODULE) is not None
    except ImportError:  # no `services` package at all
        found = False
    if not found:
        print("loramux serve needs the loramux server package (pip install loramux)",
              file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", SERVE_MODULE, *serve_args])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # everything after `serve` belongs to the launcher
        return run_serve(argv[1:])
    args = build_parser().parse_args(argv)
    from loramux.client import LoramuxError
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "status":
            return run_status(args)
        return run_adapters(args)
    except LoramuxError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as err:  # TLS files missing or incomplete
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

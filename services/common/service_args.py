"""The command-line checks the gateway and the control plane share, run before either
starts: required options, adapter roots, engine replica addresses, ZMQ keys and TLS."""
from __future__ import annotations

import os

from loramux_core import curve
from loramux_core.safe_files import roots_from, roots_problem
from loramux_services.common import replicas, tls


def check(args, required: tuple[str, ...], *, require_roots: bool,
          check_token: bool) -> str | None:
    """What is wrong with `args`, as one line, or None; on success sets `args.engines`,
    `args.keys` and `args.tls`. `check_token`: refuse a bearer token sent in plaintext."""
    missing = [n for n in required if not getattr(args, n)]
    if missing:
        return ("missing required option(s): "
                + ", ".join("--" + m.replace("_", "-") for m in missing))
    roots = roots_from(args.adapter_root, os.environ)
    if require_roots and not roots:
        return "at least one --adapter-root is required"
    if (why := roots_problem(roots)) is not None:
        return why
    try:
        args.engines = replicas.addresses(args.engine_input, args.engine_output)
        args.keys = curve.keys_from_args(args)
        args.tls = tls.from_args(args)
        if check_token:
            tls.check_token_transport(args.listen, args.auth_token, args.tls,
                                      args.allow_plaintext_token)
    except ValueError as err:  # ZmqKeyError and TLSConfigError among them
        return str(err)
    return None

"""`loramux adapters`: the control-plane options (--control, --token, TLS) may come before
or after the action, as users type them; after it they win, absent they leave the earlier
value or the default."""
from __future__ import annotations

import pytest

from loramux.cli import DEFAULT_CONTROL, build_parser


@pytest.mark.parametrize("argv, control, token, tls", [
    (["adapters", "list"], DEFAULT_CONTROL, None, False),
    (["adapters", "--control", "a:1", "list"], "a:1", None, False),
    (["adapters", "list", "--control", "b:2", "--token", "t"], "b:2", "t", False),
    (["adapters", "--control", "a:1", "--token", "t", "get", "n", "--control", "b:2", "--tls"],
     "b:2", "t", True),
    (["adapters", "load", "n", "--path", "p", "--control", "b:2"], "b:2", None, False),
])
def test_control_flags_before_or_after_the_action(argv, control, token, tls, monkeypatch):
    for var in ("LORAMUX_CONTROL", "LORAMUX_ADMIN_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(argv)
    assert (args.control, args.token, args.tls) == (control, token, tls)

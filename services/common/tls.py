"""TLS for the gateway's and the control plane's gRPC ports, and the rule that a bearer
token never crosses a network in plaintext.

--tls-cert/--tls-key serve TLS; --tls-client-ca also requires every client to present a
certificate signed by that CA (mTLS; a client without one fails the handshake). A bearer
token on a port bound beyond loopback without TLS is refused at start, unless
--allow-plaintext-token says the network in between is trusted (e.g. a private container
network whose port is published on the host's loopback only)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import ssl
from dataclasses import dataclass

import grpc


class TLSConfigError(ValueError):
    """The TLS options are incomplete or unreadable, or a token would travel in plaintext."""


@dataclass(frozen=True)
class ServerTLS:
    """PEM files (checked readable at start) of a TLS port."""
    cert: str                        # certificate chain
    key: str                         # its private key
    client_ca: str | None = None     # set: clients must present a certificate it signed

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
            root_certificates=ca, require_client_auth=ca is not None)

    def uvicorn_options(self) -> dict:
        """The same TLS for the gateway's HTTP API (uvicorn.Config keywords)."""
        opts = {"ssl_certfile": self.cert, "ssl_keyfile": self.key}
        if self.client_ca:
            opts.update(ssl_ca_certs=self.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return opts


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--tls-cert", default=env("LORAMUX_TLS_CERT"),
                   help="PEM certificate (chain) to serve TLS with ($LORAMUX_TLS_CERT)")
    p.add_argument("--tls-key", default=env("LORAMUX_TLS_KEY"),
                   help="PEM private key of --tls-cert ($LORAMUX_TLS_KEY)")
    p.add_argument("--tls-client-ca", default=env("LORAMUX_TLS_CLIENT_CA"),
                   help="PEM CA: require client certificates it signed, mTLS "
                        "($LORAMUX_TLS_CLIENT_CA)")
    p.add_argument("--allow-plaintext-token", action="store_true",
                   default=env("LORAMUX_ALLOW_PLAINTEXT_TOKEN", "") not in ("", "0"),
                   help="accept a bearer token on a non-loopback address without TLS "
                        "($LORAMUX_ALLOW_PLAINTEXT_TOKEN=1)")


def from_args(args) -> ServerTLS | None:
    """The server TLS of --tls-cert/--tls-key/--tls-client-ca, or None without them."""
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise TLSConfigError("--tls-cert and --tls-key go together"
                             + (" (--tls-client-ca needs both)" if args.tls_client_ca else ""))
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca or None)
    tls.credentials()  # every file readable and PEM, now rather than at the first call
    return tls


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise TLSConfigError(f"{flag} {path}: {err.strerror}") from None
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"{flag} {path}: not a PEM file")
    return data


def is_loopback(listen: str) -> bool:
    """True when a "host:port" bind address is reachable from this host only."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name or an interface: assume reachable from outside


def check_token_transport(listen: str, token: str | None, tls: ServerTLS | None,
                          allow_plaintext: bool) -> None:
    """Refuse a bearer token that would cross a network in plaintext."""
    if token and tls is None and not allow_plaintext and not is_loopback(listen):
        raise TLSConfigError(
            f"a bearer token on {listen} without TLS would travel in plaintext: give "
            "--tls-cert/--tls-key, bind to loopback, or pass --allow-plaintext-token")

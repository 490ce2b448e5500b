"""TLS for the clients: how to reach a gateway or control plane started with --tls-cert."""
from __future__ import annotations

import os
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class TLS:
    """Client side of a TLS port.

    ca: PEM file of the CA that signed the server's certificate (None: the system roots);
    cert, key: this client's certificate and key, for a server that requires them (mTLS);
    server_name: the name to check in the server's certificate when it differs from the
    host in the target (e.g. a certificate for "loramux.internal" reached at 127.0.0.1)."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key (cert and key together)")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca), private_key=_read(self.key),
            certificate_chain=_read(self.cert))

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def channel(target: str, tls: TLS | None) -> grpc.Channel:
    """A plaintext channel, or a TLS one when `tls` is given."""
    if tls is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, tls.credentials(), options=tls.options())


def aio_channel(target: str, tls: TLS | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, tls.credentials(), options=tls.options())


def add_arguments(p, *, cert_flag: str = "--tls-cert", key_flag: str = "--tls-key") -> None:
    """Client TLS options (argparse), with $LORAMUX_TLS_CA, $LORAMUX_TLS_CLIENT_CERT,
    $LORAMUX_TLS_CLIENT_KEY and $LORAMUX_TLS_SERVER_NAME as defaults."""
    env = os.environ.get
    p.add_argument("--tls", action="store_true",
                   help="use TLS with the system's root certificates")
    p.add_argument("--tls-ca", default=env("LORAMUX_TLS_CA"),
                   help="PEM CA that signed the server's certificate (implies --tls)")
    p.add_argument(cert_flag, dest="tls_client_cert", default=env("LORAMUX_TLS_CLIENT_CERT"),
                   help="PEM client certificate, for a server that requires one (mTLS)")
    p.add_argument(key_flag, dest="tls_client_key", default=env("LORAMUX_TLS_CLIENT_KEY"),
                   help="PEM private key of the client certificate")
    p.add_argument("--tls-server-name", default=env("LORAMUX_TLS_SERVER_NAME"),
                   help="name to check in the server's certificate instead of the target host")


def from_args(args) -> TLS | None:
    """The TLS of add_arguments' options; None when none of them is given."""
    fields = (args.tls_ca, args.tls_client_cert, args.tls_client_key, args.tls_server_name)
    if not (args.tls or any(fields)):
        return None
    return TLS(*(f or None for f in fields))  # an empty variable is not a file

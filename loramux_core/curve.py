"""Who may speak on the service's ZMQ sockets: CURVE keys made per run, checked by a ZAP
authenticator.

A key directory (mode 0700) holds two key pairs in ZeroMQ's certificate format:

    server.key          server.key_secret     bound sockets: the engine's input and
                                              output, the control plane's adapter table
    client.key          client.key_secret     every connecting process of the service:
                                              control plane, gateway, health probe

A bound socket is a CURVE server with the server secret key; a ZAP authenticator in the
binding process admits only the client public key of the same directory, and
ZAP_ENFORCE_DOMAIN makes a socket whose authenticator is not running refuse everyone
(fail closed). A peer without the keys completes no handshake: it can neither send a
message to the engine nor read a byte of what the engine or the control plane publish.
Secret files are written 0600 and refused when others may read them (as ssh does).

`python -m loramux_core.curve DIR` writes a fresh directory (`--keep`: unless DIR holds
a usable one already; docker-compose runs it so into the `zmq-keys` volume that only the
service's containers mount)."""
from __future__ import annotations

import argparse
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

KEYS_ENV = "LORAMUX_ZMQ_KEYS"
INSECURE_ENV = "LORAMUX_INSECURE_ZMQ"
ZAP_DOMAIN = b"loramux"


class ZmqKeyError(ValueError):
    """The key directory is missing, incomplete or readable by others."""


@dataclass(frozen=True)
class ZmqKeys:
    """The run's two CURVE key pairs (z85 bytes), loaded from `directory`."""
    directory: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "ZmqKeys":
        d = Path(directory)
        if not d.is_dir():
            raise ZmqKeyError(f"ZMQ key directory {str(d)!r} does not exist")
        pairs = [_load_pair(d, name) for name in ("server", "client")]
        return cls(str(d), *pairs[0], *pairs[1])

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (before bind) a CURVE server that only authenticated peers reach."""
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Make `sock` (before connect) a CURVE client of this run's servers."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def _load_pair(d: Path, name: str) -> tuple[bytes, bytes]:
    secret_file = d / f"{name}.key_secret"
    if not secret_file.is_file():
        raise ZmqKeyError(f"ZMQ key directory {str(d)!r} has no {secret_file.name}")
    mode = secret_file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ZmqKeyError(f"{secret_file} is accessible to other users "
                        f"(mode {stat.S_IMODE(mode):o}); it must be 0600")
    public, secret = zmq.auth.load_certificate(secret_file)
    if not secret:
        raise ZmqKeyError(f"{secret_file} holds no secret key")
    return public, secret


def generate_keys(directory: str | os.PathLike) -> ZmqKeys:
    """Write fresh server and client key pairs into `directory` (made 0700; secrets 0600;
    existing pairs replaced) and return them."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    old = os.umask(0o077)
    try:
        for name in ("server", "client"):
            for suffix in (".key", ".key_secret"):
                (d / f"{name}{suffix}").unlink(missing_ok=True)
            zmq.auth.create_certificates(d, name)
    finally:
        os.umask(old)
    for name in ("server", "client"):
        os.chmod(d / f"{name}.key_secret", 0o600)
    return ZmqKeys.load(d)


class _AllowClient:
    def __init__(self, allowed: bytes):
        self._allowed = allowed

    def callback(self, domain: str, z85_key: bytes) -> bool:
        return z85_key == self._allowed


def start_authenticator(ctx: zmq.Context, keys: ZmqKeys) -> ThreadAuthenticator:
    """Start the ZAP handler of `ctx` admitting only the run's client key; stop() it after
    the context's server sockets are closed."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                  credentials_provider=_AllowClient(keys.client_public))
    return auth


# ---- command-line options shared by the engine, the control plane and the gateway ----

def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--zmq-keys", default=env(KEYS_ENV),
                   help="CURVE key directory for the ZMQ sockets (python -m loramux_core.curve "
                        f"DIR makes one; ${KEYS_ENV})")
    p.add_argument("--insecure-zmq", action="store_true",
                   default=env(INSECURE_ENV, "") not in ("", "0"),
                   help="run the ZMQ sockets without CURVE: any local process can use them "
                        f"(${INSECURE_ENV}=1)")


def keys_from_args(args) -> ZmqKeys | None:
    """The keys named by --zmq-keys; None with --insecure-zmq. Raises ZmqKeyError (with what
    to do) when neither is given or the directory is unusable."""
    if args.zmq_keys:
        return ZmqKeys.load(args.zmq_keys)
    if args.insecure_zmq:
        return None
    raise ZmqKeyError(f"no ZMQ keys: pass --zmq-keys DIR (or set ${KEYS_ENV}; make one with "
                    "`python -m loramux_core.curve DIR`), or --insecure-zmq to let any local "
                    "process use the engine's sockets")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loramux_core.curve",
                                description="write fresh CURVE keys for a loramux run")
    p.add_argument("directory")
    p.add_argument("--keep", action="store_true",
                   help="keep the keys already in DIR if they are complete and private")
    args = p.parse_args(argv)
    if args.keep:
        try:
            ZmqKeys.load(args.directory)
            print(f"keeping the keys in {args.directory}", file=sys.stderr)
            return 0
        except ZmqKeyError:
            pass
    keys = generate_keys(args.directory)
    print(f"wrote server and client keys to {keys.directory}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

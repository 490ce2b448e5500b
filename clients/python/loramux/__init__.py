"""loramux client SDK: sync and asyncio clients for Generate and AdapterAdmin.

Needs only grpcio and protobuf. The generated messages live in `loramux.v1`."""
from loramux.client import AdminClient, GenerateClient, LoramuxError
from loramux.tls import TLS

__all__ = ["GenerateClient", "AdminClient", "LoramuxError", "TLS"]

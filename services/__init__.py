"""loramux services: the gRPC gateway (Generate), the control plane (AdapterAdmin) and
the `loramux serve` launcher. Each service is its own process; see docs/ARCHITECTURE.md."""

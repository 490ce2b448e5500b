"""loramux services: the gRPC gateway (Generate), the control plane (AdapterAdmin) and
the `loramux serve` launcher. Each service is its own process; see docs/ARCHITECTURE.md."""
if __name__ != "loramux_services":   # services/ found through a path entry: one name a module
    raise ImportError(f"services/ installs as loramux_services, not as {__name__}")


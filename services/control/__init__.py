"""The control plane: AdapterAdminService, the SQLite registry, and the engine link."""

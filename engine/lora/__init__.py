"""LoRA adapters: PEFT loading (weights.py, from loramux_core/adapter/plan.py), the device
slot pool (pool.py), and the per-step batch that applies every token's adapter (batch.py).
The exports import on first use (engine/lazy.py); the adapter config and plan they read
are loramux_core/adapter/."""
from loramux_engine.lazy import lazy_exports

_EXPORTS = {"LoRABatch": "loramux_engine.lora.batch",
            "AdapterPlan": "loramux_core.adapter.plan",
            "LoRASlotPool": "loramux_engine.lora.pool",
            **dict.fromkeys(("GroupWeights", "LoRAWeights", "load_lora", "validate_lora"),
                            "loramux_engine.lora.weights")}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["AdapterPlan", "GroupWeights", "LoRABatch", "LoRASlotPool", "LoRAWeights",
           "load_lora", "validate_lora"]

"""LoRA adapters: PEFT loading and validation (config.py, plan.py, weights.py), the device
slot pool (pool.py), and the per-step batch that applies every token's adapter (batch.py)."""
from engine.lora.batch import LoRABatch
from engine.lora.plan import AdapterPlan
from engine.lora.pool import LoRASlotPool
from engine.lora.weights import GroupWeights, LoRAWeights, load_lora, validate_lora

__all__ = ["AdapterPlan", "GroupWeights", "LoRABatch", "LoRASlotPool", "LoRAWeights",
           "load_lora", "validate_lora"]

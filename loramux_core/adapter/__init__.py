"""A PEFT LoRA adapter checked against the base model before any tensor is built:
adapter_config.json (config.py, with PEFT's patterns in patterns.py), the safetensors
header (safetensors_buffer.py) and the plan that accepts or refuses it (plan.py,
expert_plan.py). The control plane validates with it; the engine loads from its plan."""

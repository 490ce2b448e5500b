"""The base model as the control plane, the gateway and the engine all read it: the model
registry (archs/), config.json parsed into a ModelConfig (hf_config.py), the LoRA targets'
geometry (lora_targets.py) and the tensor-parallel split (sharding.py). Torch-free."""

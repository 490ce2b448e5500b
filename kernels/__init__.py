"""Hot-path kernels. Every kernel has a plain-torch reference (`*_ref.py`): it is the CPU
path and the oracle the Triton kernels are tested against."""

"""Hot-path kernels. Every kernel has a plain-torch reference (`*_ref.py`): it is the CPU
path and the oracle the Triton kernels are tested against."""
if __name__ != "loramux_kernels":   # kernels/ found through a path entry: one name a module
    raise ImportError(f"kernels/ installs as loramux_kernels, not as {__name__}")


"""Hot-path kernels. Every kernel has a plain-torch reference (`*_ref.py`): it is the CPU
path and the oracle the Triton kernels are tested against."""
if __name__ != "loramux_kernels":
    # kernels/ found through a path entry (the checkout's root on sys.path) under the name
    # of Hugging Face's package. Not an error: transformers imports whatever `kernels` it
    # finds to probe it, and must not break. An empty stand-in instead: no submodules (one
    # name a module) and no file, which such probes read as "not installed".
    __path__ = []
    __file__ = None


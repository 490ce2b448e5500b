"""Benchmarks, run from the checkout as `python -m benchmarks.SUITE` (benchmarks/README.md).

`python -m` puts the checkout first on sys.path, where its folders would hide installed
packages of the same name: kernels/ hides Hugging Face's `kernels`, which transformers
imports (the HF + PEFT baselines). The checkout moves after site-packages; loramux itself
imports by its installed names (loramux_engine, ...), and `benchmarks` stays importable.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT] + [_ROOT]

"""Every Triton kernel reads only the module globals a compiled kernel may read: a global
that is not a constexpr (a plain `SUB = 16` beside the kernels) compiles on a GPU into
"Cannot access global variable", while the CPU interpreter, which runs the kernels as
Python, accepts it. So this checks, on the CPU, the rule Triton's code generator applies
(triton/compiler/code_generator.py global_lookup) to each global name a kernel's code
reads."""
import importlib
import pkgutil
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

KERNELS = (JITFunction, InterpretedFunction)  # compiled, or under TRITON_INTERPRET=1

import loramux_kernels


def _modules():
    for info in pkgutil.walk_packages(loramux_kernels.__path__, "loramux_kernels."):
        yield importlib.import_module(info.name)


def _jit_functions():
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, KERNELS) and value.fn.__module__ == module.__name__:
                yield f"{module.__name__}.{name}", value


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _allowed(value) -> bool:
    return (isinstance(value, (types.ModuleType, *KERNELS, tl.constexpr, tl.dtype))
            or getattr(value, "__triton_builtin__", False)
            or getattr(value, "__module__", "").startswith("triton.language")
            or (isinstance(value, tuple) and hasattr(value, "_fields")))


JIT = dict(_jit_functions())


def test_the_kernels_are_found():
    assert {"loramux_kernels.lora.token.lora_shrink_tok_kernel",
            "loramux_kernels.lora.token.lora_expand_tok_kernel"} <= set(JIT)
    assert any(name.startswith("loramux_kernels.attention") for name in JIT)


@pytest.mark.parametrize("name", sorted(JIT))
def test_a_kernel_reads_only_globals_a_compiled_kernel_may(name):
    fn = JIT[name].fn
    bad = {g: type(fn.__globals__[g]).__name__ for g in set(_names(fn.__code__))
           if g in fn.__globals__ and not _allowed(fn.__globals__[g])}
    assert not bad, f"{name} reads non-constexpr globals: {bad}"


def test_the_check_sees_a_plain_global():
    module = types.ModuleType("kernels_probe")
    exec("import triton\nimport triton.language as tl\nSUB = 16\n"
         "def k(x_ptr):\n    tl.store(x_ptr, SUB)\n", module.__dict__)
    fn = module.k
    assert [g for g in _names(fn.__code__)
            if g in fn.__globals__ and not _allowed(fn.__globals__[g])] == ["SUB"]
    assert triton  # the probe's imports resolve to modules, which are allowed

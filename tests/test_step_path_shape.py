"""The engine's step path reads top to bottom: no function in its modules is over 50 lines
(docstring and decorators included), checked on the source with ast."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP_PATH = (
    "engine/engine.py", "engine/scheduler.py", "engine/runner.py", "engine/executor.py",
    "engine/distributed/executor.py", "engine/distributed/worker.py",
    "engine/output_processor.py", "engine/assembly.py", "engine/pending.py",
)
MAX_LINES = 50


def long_functions(source: str, name: str = "<source>") -> list[str]:
    """'file:line function (N lines)' for every function or method over MAX_LINES."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            n = node.end_lineno - first + 1
            if n > MAX_LINES:
                found.append(f"{name}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_on_the_step_path_is_over_50_lines():
    found = [f for rel in STEP_PATH
             for f in long_functions((ROOT / rel).read_text(), rel)]
    assert not found, "split these: " + "; ".join(found)


def test_the_check_sees_a_long_method_and_its_decorators():
    body = "".join(f"        x{i} = {i}\n" for i in range(47))
    method = f"class A:\n    @staticmethod\n    def f():\n        '''doc'''\n{body}"
    assert long_functions(method) == []                       # 50 lines with the decorator
    assert long_functions(method + "        return x0\n") == ["<source>:3 f (51 lines)"]

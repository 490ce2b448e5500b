"""Constrained decoding (JSON schema, JSON object, regex, choice, grammar) with llguidance:
compiles off the step thread (compiler.py), one matcher per sequence (constraint.py), the
step's token bitmask (masks.py) and the engine's view of all three (grammars.py)."""
from loramux_engine.structured.compiler import CompilerConfig, GrammarCompiler
from loramux_engine.structured.constraint import Constraint, GrammarRejectedError
from loramux_engine.structured.grammars import Grammars

__all__ = ["CompilerConfig", "Constraint", "GrammarCompiler", "GrammarRejectedError",
           "Grammars"]

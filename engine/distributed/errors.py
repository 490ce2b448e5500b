"""The error a tensor-parallel engine raises when one of its ranks is gone."""
from __future__ import annotations

from engine.errors import LoramuxError


class EngineDeadError(LoramuxError):
    """A tensor-parallel rank died or stopped answering. The engine cannot continue: the
    other ranks are stopped, and every later call raises this error again."""

"""The speculative cycle as a table of transitions, a runner, and checked mode."""

from .checks import InvariantViolation
from .runner import NoTransition, TraceEvent, generate, run_cycle, select, step
from .table import TABLE, Transition
from .transitions import CycleError

__all__ = [
    "TABLE",
    "Transition",
    "step",
    "run_cycle",
    "generate",
    "select",
    "TraceEvent",
    "InvariantViolation",
    "NoTransition",
    "CycleError",
]

"""speccycle: speculative decoding as a declarative state machine.

The package is the repository root; its subpackages are the required folders:
`speccycle.core` (records, config, tree math, ports), `speccycle.statemachine` (the transition
table, the runner, checked mode), `speccycle.backends` (torch reference, cuda, rocm) and
`speccycle.engine` (the reference engine on real models).
"""

__version__ = "0.1.0"

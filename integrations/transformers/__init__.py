"""The library over transformers causal LMs: `ports` (the `TargetModel` and `DraftModel` ports over a transformers
model, its KV in the library's paged pool), `speculator` (the cycle over them), `bench` (against transformers' own
assisted generation and prompt lookup).

Needs the ``transformers`` package (the ``transformers`` extra); nothing else of speccycle imports this package.
"""

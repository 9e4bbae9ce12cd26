"""Draft-head training: EAGLE-1 and EAGLE-3 heads for a Llama-family target, by self-distillation.

`pipeline` is ``speccycle train-draft`` (stages generate / train / eval); `data` makes the
self-distilled token data, `features` runs the frozen target over padded batches, `head` is the
trainable head (the engine's `EagleHead` function, unrolled over draft steps), `trainer` the loop,
`evaluate` the Spec-Bench tau report. See docs/training.md.
"""

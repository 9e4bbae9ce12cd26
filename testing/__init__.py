"""Deterministic, cheap models that satisfy the ports, for tests and for engines' own test suites.

`HashedNgramTarget` is a language model whose next token is a hash of the last few tokens it reads
back from its KV cache; `NoisyDraft` agrees with it at a chosen rate; `TreeLookupDraft` proposes
random trees. They check what they read (positions contiguous, features paired with the right
position), so a wrong slot, position or KV move fails loudly instead of quietly losing acceptance.
"""

from .models import HashedNgramTarget, NoisyDraft, TreeLookupDraft, ngram_logits
from .pool import FingerprintPool

__all__ = ["HashedNgramTarget", "NoisyDraft", "TreeLookupDraft", "FingerprintPool", "ngram_logits"]

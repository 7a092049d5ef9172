"""rltrain's kernels, imported as `rltrain.kernels` (pyproject maps this directory there).

Fused log-prob and entropy of sampled tokens for large vocabularies (logprob.py), with the
Triton kernels in triton_logprob.py and plain torch references in reference.py.
"""

from .logprob import linear_logprobs_entropy, logprobs_entropy
from .reference import reference_linear_logprobs_entropy, reference_logprobs_entropy

__all__ = [
    "linear_logprobs_entropy",
    "logprobs_entropy",
    "reference_linear_logprobs_entropy",
    "reference_logprobs_entropy",
]

"""Output-layer and verification ops, one function each, behind one dispatcher (kernels/dispatch.py):
the torch references by default, the Triton kernels where SPECSTREAM_KERNELS=triton says (on CUDA
they are slower than torch today: kernels/dispatch.py).

Each op's file holds its Triton kernel, its launcher and the torch reference it must match. The
ops read logits, or final hidden states with the LM head (``Hidden``, kernels/lm_head.py), which
the Triton kernels multiply tile by tile instead of building [rows, vocab] logits.
"""

from kernels.argmax import argmax, best_token
from kernels.cuts import cut_thresholds
from kernels.dispatch import backend, use
from kernels.lm_head import Hidden, OutputHead
from kernels.logprobs import token_logprobs
from kernels.nbest import topk_logprobs
from kernels.sample import sample
from kernels.speculative import speculative_verify, speculative_verify_fused
from kernels.tree_sampling import tree_speculative_verify
from kernels.verify import greedy_verify

__all__ = ["Hidden", "OutputHead", "argmax", "backend", "best_token", "cut_thresholds", "greedy_verify", "sample",
           "speculative_verify", "speculative_verify_fused", "token_logprobs", "topk_logprobs",
           "tree_speculative_verify", "use"]

"""Functions the generated code calls besides ATen ops and ``_c10d_functional`` collectives."""

from .autograd import (gathered_batch, input_with_full_grad, local_piece, onto_device, param_all_gather, param_local,
                       per_rank, reduced_output, returned)
from .cross_entropy import local_logsumexp, vocab_parallel_cross_entropy
from .grad_reduction import reduce_grads_in_bucket

__all__ = ["gathered_batch", "input_with_full_grad", "local_logsumexp", "local_piece", "onto_device", "param_all_gather",
           "param_local", "per_rank", "reduce_grads_in_bucket",
           "reduced_output", "returned", "vocab_parallel_cross_entropy"]

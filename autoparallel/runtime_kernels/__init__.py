"""Functions the generated code calls besides ATen ops and ``_c10d_functional`` collectives."""

from .autograd import param_local, per_rank, returned
from .grad_reduction import reduce_grads_in_bucket

__all__ = ["param_local", "per_rank", "reduce_grads_in_bucket", "returned"]

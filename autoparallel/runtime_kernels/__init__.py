"""Functions the generated code calls besides ATen ops and ``_c10d_functional`` collectives."""

from .autograd import grad_bucket, param_local, per_rank, returned

__all__ = ["grad_bucket", "param_local", "per_rank", "returned"]

"""FCP: flexible context parallelism.

The C++ library's Python face. ``fcp.torch`` has what a PyTorch training loop uses: a
``Batch`` made once per step over the caller's process group (or mpi4py communicator) and an
``attention`` autograd function per layer. This module only re-exports the binding.
"""
from ._fcp import Error  # noqa: F401  (raised for bad input, with a one-line message)

__all__ = ["Error"]

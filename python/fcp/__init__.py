"""FCP: flexible context parallelism.

The C++ library's Python face. ``fcp.torch`` has what a PyTorch training loop uses: a
``Batch`` made once per step over the caller's process group (or mpi4py communicator) and an
``attention`` autograd function per layer. This module only re-exports the binding.
"""
# Every error FCP raises is an Error (a RuntimeError) with a one-line message: bad input an
# InvalidArgument (a ValueError too), failed or timed-out communication a TransportError.
from ._fcp import Error, InvalidArgument, TransportError, __version__  # noqa: F401

__all__ = ["Error", "InvalidArgument", "TransportError", "__version__"]

"""The `torch` backend's room: every op in plain torch, each the oracle its kernels are tested
against (a kernel in `kernels.cpu` or `kernels.triton` has its reference here under the same
module name)."""

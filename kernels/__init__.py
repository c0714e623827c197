"""GPU hot path as Triton kernels, each beside its plain-torch reference.

Every module holds `_name_kernel` (Triton), `name()` (the checked wrapper) and `name_ref()`
(plain torch: the CPU serving path and the test oracle). `kernels.registry` picks a backend.
"""

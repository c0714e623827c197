"""The `cpu` backend's room: C kernels (AVX512-BF16 and AVX2 paths) beside their ctypes wrappers.

`build` compiles each `<name>.c` once per machine; `backend.CpuBackend` binds the wrappers as
the backend's ops. Each wrapper keeps the reference's signature and numerics, and hands a
dtype or layout its C kernel does not take to the reference (`kernels.reference`).
"""

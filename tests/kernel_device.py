"""Where the kernel tests run the Triton kernels: `PDSERVE_KERNEL_DEVICE=cpu` (the default:
Triton's interpreter on CPU tensors) or `cuda` (GPU mode: compiled kernels on the GPU,
`scripts/gpu_check.sh`).

Triton decides interpreted-or-compiled when a kernel is *defined*, so the root conftest calls
`set_interpreter` before anything imports `kernels`. The interpreter is off only in GPU mode,
whatever the machine has: on a GPU machine the suite still runs interpreted unless asked.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ENV = "PDSERVE_KERNEL_DEVICE"
DEVICES = ("cpu", "cuda")


def kernel_device(environ: MutableMapping[str, str]) -> str:
    device = environ.get(ENV) or "cpu"
    if device not in DEVICES:
        raise ValueError(f"{ENV}={device!r}: use one of {', '.join(DEVICES)}")
    return device


def set_interpreter(environ: MutableMapping[str, str]) -> None:
    """TRITON_INTERPRET=1, except in GPU mode, where it is removed."""
    if kernel_device(environ) == "cuda":
        environ.pop("TRITON_INTERPRET", None)
    else:
        environ["TRITON_INTERPRET"] = "1"

"""The `triton` backend's room: the GPU kernels, each module a `_name_kernel` and its checked
wrapper `name()`; `launch` holds what the wrappers share (interpreter or GPU, tile sizes, dot
operand types). Every kernel's oracle is the op of the same name in `kernels.reference`.

Under TRITON_INTERPRET=1 (set before this room is imported) the kernels run on CPU tensors in
Triton's interpreter: the kernel tests, ~500x slower than torch, never for serving.
"""

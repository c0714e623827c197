"""The model never picks a kernel: model code (engine/models/, engine/attention.py) calls the
backend's ops and tests nothing that would choose one.

Read from the source (AST): no import from a backend's room (`pdserve.kernels.cpu`,
`.triton`, `.reference`: only the contract modules), no look at a tensor's device or layout
(`.device.type`, `.is_cuda`, `.is_cpu`, `.is_mkldnn`, `.layout`), and no comparison with a
device name, a backend name or a torch dtype, nor with the length of a KV cache tuple (how an
int8 cache was told apart). The checker is itself tested on the patterns it must catch.
"""

from __future__ import annotations

import ast

import pytest

from tests.packaging.imports import ROOT

MODEL_CODE = sorted((ROOT / "engine" / "models").glob("*.py")) + [ROOT / "engine" / "attention.py"]
CONTRACT = {"pdserve.kernels.backend", "pdserve.kernels.attention_metadata",
            "pdserve.kernels.decoder_layers", "pdserve.kernels.quant_weights",
            "pdserve.kernels.lora_mapping"}
LAYOUT_ATTRS = {"is_cuda", "is_cpu", "is_mkldnn", "layout"}
NAMES = {"cpu", "cuda", "mps", "xpu", "torch", "triton"}
DTYPES = {"float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64", "float"}


def kernel_choices(source: str) -> list[str]:
    """What in `source` could pick a kernel (see the module doc), one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pdserve.kernels"):
            if node.module not in CONTRACT:
                found.append(f"{where}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names
                      if a.name.startswith("pdserve.kernels") and a.name not in CONTRACT]
        elif isinstance(node, ast.Attribute):
            device_type = (node.attr == "type" and isinstance(node.value, ast.Attribute)
                           and node.value.attr == "device")
            if node.attr in LAYOUT_ATTRS or device_type:
                found.append(f"{where}: reads .{node.attr}")
        elif isinstance(node, ast.Compare):
            found += [f"{where}: compares with {ast.unparse(o)}"
                      for o in [node.left, *node.comparators] if _picks(o)]
    return found


def _picks(operand: ast.expr) -> bool:
    if isinstance(operand, ast.Constant):
        return operand.value in NAMES
    if isinstance(operand, ast.Attribute):  # torch.bfloat16, x.dtype, self.ops.name
        return operand.attr in DTYPES or operand.attr in ("dtype", "name")
    if isinstance(operand, ast.Call) and isinstance(operand.func, ast.Name):
        return operand.func.id == "len" and "cache" in ast.unparse(operand.args)
    return False


def test_model_code_calls_the_backend_and_picks_no_kernel():
    assert len(MODEL_CODE) >= 4, "the model code was not found"
    offenders = {str(p.relative_to(ROOT)): kernel_choices(p.read_text()) for p in MODEL_CODE}
    assert {p: f for p, f in offenders.items() if f} == {}


@pytest.mark.parametrize("snippet", [
    "from pdserve.kernels.cpu import packed_linear",
    "import pdserve.kernels.triton.rms_norm",
    "from pdserve.kernels.reference.linear import DenseLinear",
    "if x.device.type == 'cuda': pass",
    "if w.is_mkldnn: pass",
    "if weight.dim() == 4 and weight.layout: pass",
    "if k_cache.dtype == torch.bfloat16: pass",
    "pack = self.ops.name == 'cpu'",
    "int8 = len(kv_cache) == 4",
    "use = 'cuda' in str(device)",
])
def test_the_checker_catches_each_way_of_picking(snippet):
    assert kernel_choices(snippet)


def test_the_checker_lets_the_model_be_a_model():
    source = ("from pdserve.kernels.backend import KernelBackend\n"
              "q = self.ops.rms_norm(x, self.weight, self.eps, residual)\n"
              "if self.tp.size > 1: y = self.tp.all_reduce(y)\n"
              "rope = rope_tables(cfg.rope_parameters, cfg.head_dim, 4096, 512, device)\n")
    assert kernel_choices(source) == []

"""The layout holds: pyproject lists every subpackage, no import cycle, stubs match their .proto
files, a long source file says why it stays whole, nothing imports the bare folder names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.packaging.imports import ROOT, cycles, import_graph, modules, package_dirs

# House style: a file holds one concept and is named after it; past ~400 lines its docstring
# says why it stays whole, under this heading (never split a concept only to get under a count).
LONG_FILE_LINES = 400
WHY_WHOLE = "Why one file:"
BARE = {"proto", "engine", "kernels", "router", "kvtransfer", "prefill_worker", "decode_worker"}


def test_pyproject_lists_every_subpackage() -> None:
    dirs = package_dirs()
    on_disk = set()
    for package, folder in dirs.items():
        assert (folder / "__init__.py").is_file(), f"{package}: {folder} is not a package"
        for init in folder.glob("*/__init__.py"):
            on_disk.add(f"{package}.{init.parent.name}")
    missing = on_disk - set(dirs)
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50, "the import graph found too few modules to mean anything"
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_grpc_stubs_match_their_protos() -> None:
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_a_long_source_file_says_why_it_stays_whole() -> None:
    sources = list(modules().values()) + list((ROOT / "benchmarks").glob("*.py")) + list(
        (ROOT / "scripts").glob("*.py"))
    generated = re.compile(r"_pb2(_grpc)?\.py$")
    long = [p for p in sources
            if not generated.search(p.name) and len(p.read_text().splitlines()) > LONG_FILE_LINES]
    unexplained = [str(p.relative_to(ROOT)) for p in long if not says_why_whole(p.read_text())]
    assert unexplained == [], f"say why in the module docstring, after {WHY_WHOLE!r}"


def says_why_whole(source: str) -> bool:
    """The module docstring has a `Why one file:` paragraph with a reason in it."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    reason = doc.partition(WHY_WHOLE)[2].strip()
    return len(reason.split()) >= 5


def test_the_reason_must_be_there_and_be_one() -> None:
    assert says_why_whole('"""X.\n\nWhy one file: the parser and its states share one table."""')
    assert not says_why_whole('"""X, a long file."""\nWHY = "Why one file: a string, not the doc"')
    assert not says_why_whole('"""X.\n\nWhy one file:"""')


def test_nothing_imports_the_bare_folder_names() -> None:
    files = [p for p in ROOT.rglob("*.py")
             if not any(part.startswith((".venv", "build", ".git")) for part in p.parts)]
    offenders = [str(p.relative_to(ROOT)) for p in files if bare_imports(p)]
    assert offenders == [], "import these as pdserve.<part>"


def bare_imports(path) -> list[str]:
    """Top-level names of the folders imported without the namespace, e.g. `import engine`."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in BARE]

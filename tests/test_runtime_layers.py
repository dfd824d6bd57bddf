"""The layering of docs/ARCHITECTURE.md, checked on the source: which module may import which.

API (jax_ep/*.py)  ->  backends/  and  runtime/   ;   backends/ -> never runtime/ or the ops
runtime/transports (peer, nvshmem, teams, agreement, kv, nvshmem_env) -> never runtime/lifecycle.py
launch/ -> never the ops, backends or the runtime lifecycle (it only starts processes)
Plus the one private JAX API (the distributed key-value client) stays behind runtime/kv.py, checked on the listed
jax versions, and no source file (jax_ep/*.py, the C++/CUDA of cuda/, nvshmem/, xla_ffi/) is over 600 lines.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import pytest

import jax_ep
from jax_ep.runtime import kv

ROOT = pathlib.Path(jax_ep.__file__).parent


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute module names imported by a file of the package (relative imports resolved)."""
    rel = path.relative_to(ROOT.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith("jax_ep")}


def _files(sub: str):
    return sorted((ROOT / sub).glob("*.py"))


def test_backends_never_import_the_runtime_or_the_ops():
    for f in _files("backends"):
        bad = {m for m in _imports(f) if m.startswith(("jax_ep.runtime", "jax_ep.ops",
                                                       "jax_ep.launch"))}
        assert not bad, f"{f.name} imports {bad}"


def test_transports_never_import_the_lifecycle():
    for f in _files("runtime"):
        if f.name in ("lifecycle.py", "__init__.py"):
            continue
        bad = {m for m in _imports(f) if m.startswith("jax_ep.runtime.lifecycle") or m.startswith(
            ("jax_ep.ops", "jax_ep.backends")) or m == "jax_ep.runtime.setup"}
        assert not bad, f"runtime/{f.name} imports {bad}"


def test_launcher_starts_processes_only():
    for f in _files("launch"):
        bad = {m for m in _imports(f) if m.startswith(("jax_ep.ops", "jax_ep.backends",
                                                       "jax_ep.runtime.lifecycle"))}
        assert not bad, f"launch/{f.name} imports {bad}"


MAX_LINES = 600
# folder of the repository -> the source files whose length is checked there
SOURCES = {"jax_ep": (".py",), "cuda": (".cu", ".cc", ".h", ".cuh"), "nvshmem": (".cu", ".cc", ".h", ".cuh"),
           "xla_ffi": (".cu", ".cc", ".h", ".cuh")}


@pytest.mark.parametrize("folder", sorted(SOURCES))
def test_no_file_over_600_lines(folder):
    files = [p for p in (ROOT.parent / folder).rglob("*") if p.is_file() and p.suffix in SOURCES[folder]]
    assert files, f"no {'/'.join(SOURCES[folder])} files under {folder}/: the check would pass without reading any"
    long = {str(p.relative_to(ROOT.parent)): n for p in files
            if (n := len(p.read_text(errors="replace").splitlines())) > MAX_LINES}
    assert long == {}, f"files over {MAX_LINES} lines (split them): {long}"


def test_kv_adapter_checked_on_this_jax():
    assert jax.__version__ in kv.CHECKED_JAX_VERSIONS, (
        f"jax {jax.__version__}: run the multi-process tests on it and add it to jax_ep/runtime/kv.py")
    if jax.process_count() == 1:
        with pytest.raises(jax_ep.EPError, match="jax.distributed"):
            kv.client()

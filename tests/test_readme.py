"""README.md stays true: its python programs run as written, and the files and docs it names exist.

Every ```python block of the README that is a whole program (it defines or imports every name it uses; the API
summary's fragments are not) runs in a subprocess (XLA_FLAGS only applies before jax is imported): once as written
and once with XLA_FLAGS set by the caller to 4 emulated devices, which the program must keep (the README's "For N
devices set the flag yourself"). The README must have at least one such program, and the checks the programs print
(lines ending in True / False) must all say True.
"""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import jax_ep

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEVICES_PROBE = "\nimport jax as _readme_jax\nprint('README_TEST_DEVICES', _readme_jax.device_count())\n"


def section(text: str, title: str) -> str:
    """The body of the markdown section '## <title>' (up to the next '## ')."""
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def undefined_names(code: str) -> set[str]:
    """Names the code reads but never binds (assignments, imports, definitions, arguments) and that are not
    builtins: a whole program has none. Scopes are not told apart, which only errs towards 'defined'."""
    tree = ast.parse(code)
    bound, read = set(dir(builtins)), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def readme_programs() -> list[str]:
    """The README's ```python blocks that are whole programs; at least one (the test fails without it)."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
    programs = [b for b in blocks if not undefined_names(b)]
    assert programs, (f"README.md has no python block that runs as written ({len(blocks)} python blocks, each "
                      f"using names it does not define: {[sorted(undefined_names(b))[:5] for b in blocks]})")
    return programs


def run_program(tmp_path, code: str, xla_flags: str | None) -> subprocess.CompletedProcess:
    script = tmp_path / "readme_program.py"
    script.write_text(code + DEVICES_PROBE)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    # The same jax_ep this test process imported (source tree or installed), whatever the working directory.
    package_parent = str(Path(jax_ep.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"  # the CPU test suite: emulated devices even where GPUs exist
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_undefined_names_tells_programs_from_fragments():
    assert not undefined_names("import jax_ep\ncfg = jax_ep.EPConfig(1, 2, 3, 4)\ndef f(x):\n    return x\n")
    assert undefined_names("import jax_ep\nrt = jax_ep.initialize(mesh, cfg)\n") == {"mesh", "cfg"}


@pytest.mark.parametrize("xla_flags", [None, "--xla_force_host_platform_device_count=4"],
                         ids=["as-written", "xla-flags-4"])
def test_readme_programs_run(tmp_path, xla_flags):
    checks = []
    for code in readme_programs():
        proc = run_program(tmp_path, code, xla_flags)
        out = f"--- program ---\n{code}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
        assert proc.returncode == 0, f"a README program failed:\n{out}"
        devices = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("README_TEST_DEVICES")]
        assert len(devices) == 1, out
        if xla_flags is not None:  # the caller's flag is kept: the program runs on the 4 devices asked for
            assert devices[0] == 4, out
        program_checks = [line for line in proc.stdout.splitlines() if re.search(r"\b(True|False)$", line)]
        assert not [c for c in program_checks if c.endswith("False")], f"a README program's check failed:\n{out}"
        checks += program_checks
    # The printed check is the point of the README's program (Hello dispatch: y == 2 * x * ranks visited).
    assert checks, "no README program printed a check (a line ending in True)"


def test_quick_start_names_existing_files():
    """Every repository file the Quick start, Hello dispatch and Install sections name exists."""
    text = README.read_text()
    body = "".join(section(text, t) for t in ("Quick start", "Hello dispatch", "Install"))
    paths = set(re.findall(r"\b((?:examples|tests|scripts|docs)/[\w./-]+\.(?:py|md|sh))\b", body))
    assert paths, "the README sections name no files?"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README names files that do not exist: {missing}"


def _extras_needed(example: Path) -> set[str]:
    """The pyproject extras whose packages the example imports (jax, numpy: the base dependencies)."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[\[<>=;! ]", d)[0] for d in meta["dependencies"]}
    imported = {(a.name if isinstance(n, ast.Import) else n.module or "").split(".")[0]
                for n in ast.walk(ast.parse(example.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [n])}
    needed = set()
    for extra, reqs in meta.get("optional-dependencies", {}).items():
        names = {re.split(r"[\[<>=;! ]", r)[0].replace("-", "_") for r in reqs} - base
        if names & imported:
            needed.add(extra)
    return needed


def test_quick_start_installs_what_the_examples_need():
    """The Quick start runs an example, and its install line brings every extra that example imports (flax/optax:
    'examples')."""
    quick = section(README.read_text(), "Quick start")
    runs = re.findall(r"^\s*python3? (examples/[\w/]+\.py)", quick, re.M)
    assert runs, "the Quick start runs no example"
    installs = [set(x.strip() for x in m.split(",")) for m in
                re.findall(r"pip install[^\n]*?\.\[([^\]]*)\]", quick)] or [set()]
    for example in runs:
        needed = _extras_needed(ROOT / example)
        assert any(needed <= have for have in installs), \
            f"the Quick start runs {example}, which needs the extras {sorted(needed)}; it installs {installs}"


# Files whose references must all point inside the repository (docs/SPEC.md, not the project's shared folder).
SELF_CONTAINED = ["README.md", "docs/SPEC.md", "docs/API.md", "docs/BUILDING.md", "docs/BENCHMARKS.md",
                  "docs/ARCHITECTURE.md", "docs/PROCESS_MODELS.md"]


@pytest.mark.parametrize("name", SELF_CONTAINED)
def test_docs_point_inside_the_repository(name):
    text = (ROOT / name).read_text()
    outside = [m.group(0) for m in re.finditer(r"shared folder|PERFORMANCE\.md|/work/shared", text)]
    assert not outside, f"{name} refers to files outside the repository: {outside}"
    links = set(re.findall(r"\b(docs/[\w.-]+\.md)\b", text))
    links |= {f"docs/{p}" for p in re.findall(r"\]\(([\w.-]+\.md)\)", text) if name.startswith("docs/")}
    missing = sorted(p for p in links if not (ROOT / p).exists())
    assert not missing, f"{name} links to missing docs: {missing}"

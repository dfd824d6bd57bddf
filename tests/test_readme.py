"""README.md stays true: its "Hello dispatch" block runs as written, and the files and docs it names exist.

The block is executed in a subprocess (XLA_FLAGS only applies before jax is imported): once as written (it asks
for 8 emulated CPU devices itself) and once with XLA_FLAGS set by the caller to 4 devices, as the README says.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_ep

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def section(text: str, title: str) -> str:
    """The body of the markdown section '## <title>' (up to the next '## ')."""
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def hello_dispatch_code() -> str:
    body = section(README.read_text(), "Hello dispatch")
    blocks = re.findall(r"^```python\n(.*?)^```", body, re.M | re.S)
    assert len(blocks) == 1, f"expected one python block in README's Hello dispatch, found {len(blocks)}"
    return blocks[0]


def run_snippet(tmp_path, code: str, xla_flags: str | None) -> subprocess.CompletedProcess:
    script = tmp_path / "hello_dispatch.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    # The same jax_ep this test process imported (source tree or installed), whatever the working directory.
    package_parent = str(Path(jax_ep.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_parent] + [p for p in [env.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"  # the CPU test suite: emulated devices even where GPUs exist
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("num_devices, xla_flags", [(8, None), (4, "--xla_force_host_platform_device_count=4")],
                         ids=["as-written-8", "xla-flags-4"])
def test_hello_dispatch_runs(tmp_path, num_devices, xla_flags):
    proc = run_snippet(tmp_path, hello_dispatch_code(), xla_flags)
    assert proc.returncode == 0, f"README's Hello dispatch failed:\n{proc.stdout}\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("EP")]
    assert lines, f"no result line in the output:\n{proc.stdout}\n{proc.stderr}"
    # The printed check is the point of the snippet: it must say True, on the device count asked for.
    assert lines[-1] == f"EP{num_devices} on cpu: y == 2 * x * ranks visited: True", proc.stdout


def test_quick_start_names_existing_files():
    """Every repository file the Quick start, Hello dispatch and Install sections name exists."""
    text = README.read_text()
    body = "".join(section(text, t) for t in ("Quick start", "Hello dispatch", "Install"))
    paths = set(re.findall(r"\b((?:examples|tests|scripts|docs)/[\w./-]+\.(?:py|md|sh))\b", body))
    assert paths, "the README sections name no files?"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README names files that do not exist: {missing}"


def test_quick_start_installs_what_the_examples_need():
    """The Quick start's install line brings the extra the example it runs needs (flax/optax: 'examples')."""
    quick = section(README.read_text(), "Quick start")
    if "examples/flax_moe.py" in quick:
        assert re.search(r"pip install[^\n]*\.\[[^\]]*examples", quick), "Quick start runs flax_moe.py " \
            "without installing the 'examples' extra"


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

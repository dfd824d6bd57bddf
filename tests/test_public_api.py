"""The public API surface: every exported name is documented in docs/API.md, has a docstring, and its functions are
typed (jax_ep ships py.typed)."""

from __future__ import annotations

import inspect
import pathlib

import pytest

import jax_ep

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = (ROOT / "docs" / "API.md").read_text()


@pytest.mark.parametrize("name", sorted(set(jax_ep.__all__) - {"fp8"}))
def test_exported_name_is_documented_and_has_a_docstring(name):
    obj = getattr(jax_ep, name)
    assert f"{name}" in API, f"jax_ep.{name} is exported but docs/API.md never names it"
    assert inspect.getdoc(obj), f"jax_ep.{name} has no docstring"


@pytest.mark.parametrize("name", sorted(n for n in jax_ep.__all__ if inspect.isfunction(getattr(jax_ep, n))))
def test_public_functions_are_typed(name):
    sig = inspect.signature(getattr(jax_ep, name))
    missing = [p.name for p in sig.parameters.values()
               if p.annotation is inspect.Parameter.empty and p.kind not in (p.VAR_KEYWORD,)]
    assert not missing, f"jax_ep.{name}: parameters without a type annotation: {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"jax_ep.{name}: no return annotation"


def test_py_typed_ships():
    assert (pathlib.Path(jax_ep.__file__).parent / "py.typed").exists()

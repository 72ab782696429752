"""The package's seams: every patch is in the registry, policy never asks which patch ran,
and the runtime never imports the lab or the benchmarks."""

import ast
import importlib
from pathlib import Path

import vllm_dspark
from vllm_dspark.patches import PATCHES

PACKAGE = Path(vllm_dspark.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, top-level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_every_module_that_applies_a_patch_is_in_the_registry():
    applying = {
        f"vllm_dspark.{path.relative_to(PACKAGE).with_suffix('').as_posix().replace('/', '.')}"
        for path in PACKAGE.rglob("*.py")
        if "\ndef apply(" in path.read_text()  # a module-level apply()
    }
    listed = {patch.module for patch in PATCHES}
    assert applying == listed
    for patch in PATCHES:
        assert callable(importlib.import_module(patch.module).apply), patch.module


def test_the_eager_patches_are_the_ones_applied_at_load(monkeypatch):
    from vllm_dspark import patches

    applied = []
    for patch in PATCHES:
        module = importlib.import_module(patch.module)
        monkeypatch.setattr(module, "apply", lambda name=patch.module: applied.append(name))
    patches.apply_all()
    assert applied == [patch.module for patch in PATCHES if patch.eager]


def test_capacity_policy_imports_no_patch_and_the_runtime_no_lab_or_benchmark():
    for path in PACKAGE.rglob("*.py"):
        modules = imported_modules(path)
        assert not any(m.split(".")[0] in ("lab", "benchmarks", "tests") for m in modules), path
        if path.parent.name == "capacity":
            assert not any(m.startswith("vllm_dspark.patches") for m in modules), path

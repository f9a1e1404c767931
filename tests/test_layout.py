"""The package's layering, read from the source: imports point downward only and form no cycle.

Every import counts: module level, inside functions, and under `TYPE_CHECKING`. The layers, top to bottom:

    hf_paged (public API), __main__ (the hf-paged command)
    serve/       hf-paged serve: the Engine behind transformers' server
    engine/      request, scheduler, packed step, sampling
    cache/       PagedCache and its block tables
    attention/   the "hf_paged" attention, its plans, kernels/
    storage/     allocator, layer groups, layout, pool
    registry.py, errors.py
"""

import ast
import pathlib

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "hf_paged"

# Lower rank = lower layer. A module may import its own layer and the layers below it.
RANKS = {"errors": 0, "registry": 1, "storage": 1, "attention": 2, "cache": 3, "engine": 4, "serve": 5}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> tuple[set[str], set[str]]:
    """(hf_paged modules `name` imports, top-level third-party packages it imports), from every import statement."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal, external = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one.
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "hf_paged":
                while target not in MODULES:  # `import hf_paged.x.y` of a name: the nearest module
                    target = target.rpartition(".")[0]
                if target != name:
                    internal.add(target)
            else:
                external.add(target.split(".")[0])
    return internal, external


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_import_cycles():
    graph = {name: internal for name, (internal, _) in IMPORTS.items()}
    # A package imports its own submodules to re-export them; a submodule imports siblings, never its package.
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("name", sorted(name for name in MODULES if _layer(name) in RANKS))
def test_imports_point_downward(name):
    internal, _ = IMPORTS[name]
    own = RANKS[_layer(name)]
    upward = sorted(target for target in internal if _layer(target) is None or RANKS[_layer(target)] > own)
    assert not upward, f"{name} (layer {_layer(name)}) imports upward: {upward}"


def test_storage_and_registry_do_not_import_each_other():
    for name, (internal, _) in IMPORTS.items():
        other = {"storage": "registry", "registry": "storage"}.get(_layer(name))
        assert not any(_layer(target) == other for target in internal), (name, internal)


@pytest.mark.parametrize("name", ["hf_paged.storage.allocator", "hf_paged.storage.layer_groups"])
def test_block_bookkeeping_imports_neither_torch_nor_transformers(name):
    _, external = IMPORTS[name]
    assert not external & {"torch", "transformers", "triton"}, external


@pytest.mark.parametrize("name", sorted(name for name in MODULES if name.startswith("hf_paged.attention.kernels")))
def test_kernels_take_plain_tensors(name):
    internal, external = IMPORTS[name]
    assert "transformers" not in external
    assert all(target.startswith("hf_paged.attention.kernels") for target in internal), internal

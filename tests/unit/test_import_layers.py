"""Package imports point down the layer order only, never up, never in a circle (docs/architecture.md).

Every module of mmlora is parsed (ast, nothing imported) and each ``mmlora.<package>`` it imports is
checked against LAYERS: a package may import its own layer or a lower one. Top-level modules count as
packages of their own (``mmlora.config`` is a leaf; ``mmlora.demo`` sits with the apps).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "mmlora"

# Bottom to top. Same-layer packages may not import each other either (that is how cycles start).
LAYERS: list[set[str]] = [
    {
        "forward",
        "config",
        "registry",
        "triton_launch",
    },  # leaf: forward data, frozen config, the by-name registry, cheap Triton launches
    {"backends", "distributed"},  # LoRA kernels behind add_lora; tensor-parallel group and step broadcast
    {"layers"},  # attention, rotary, fused ops
    {"lora"},  # adapters: read, registry, pool, LoRALinear, manager
    {"models"},  # model families, loader, presets
    {"multimodal", "hub"},  # request-side image processing and M-RoPE; Hugging Face Hub resolution
    {"preflight"},  # configuration checks before any weight is read (engine, server, app, bench)
    {"kvcache"},  # paged KV cache
    {"engine"},  # scheduler, runner, CUDA graphs, engine, background thread
    {"server"},  # HTTP: native, OpenAI, admin, metrics
    {"serve"},  # Ray Serve scale-out: replicas running the server's app, an adapter-routing ingress
    {"app", "bench", "demo", "launch_server", "__init__", "__main__"},  # entry points, UI, benchmarks
]
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package(module_path: Path) -> str:
    rel = module_path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> set[str]:
    """mmlora packages imported by one file (absolute ``mmlora.x`` imports; relative ones stay inside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mmlora" and len(parts) > 1:
                found.add(parts[1])
    return found


def _graph() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        pkg = _package(path)
        for dep in _imports(path) - {pkg}:
            graph.setdefault(pkg, {}).setdefault(dep, []).append(str(path.relative_to(ROOT.parent)))
    return graph


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in ROOT.rglob("*.py")}
    assert packages <= set(RANK), f"add to LAYERS: {sorted(packages - set(RANK))}"


def test_imports_point_down_only() -> None:
    upward = [
        f"{pkg} -> {dep} ({', '.join(files)})"
        for pkg, deps in _graph().items()
        for dep, files in deps.items()
        if dep in RANK and RANK[dep] >= RANK[pkg]
    ]
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_package_cycle() -> None:
    graph = {pkg: set(deps) for pkg, deps in _graph().items()}
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(pkg: str, stack: list[str]) -> None:
        state[pkg] = 1
        for dep in sorted(graph.get(pkg, ())):
            if state.get(dep) == 1:
                raise AssertionError(
                    "package import cycle: " + " -> ".join(stack[stack.index(dep) :] + [dep])
                )
            if dep not in state:
                visit(dep, stack + [dep])
        state[pkg] = 2

    for pkg in sorted(graph):
        if pkg not in state:
            visit(pkg, [pkg])


def test_forward_imports_nothing_of_mmlora() -> None:
    for path in (ROOT / "forward").rglob("*.py"):
        assert _imports(path) <= {"forward"}, path

"""The package's modules import each other without a circle: every module can be read knowing only
the modules below it. The graph is built from the source (no module is imported), with every
package-internal import as an edge, wherever it is written (module level, inside a function, a
package __init__'s re-exports). Imports under `if TYPE_CHECKING:` are left out: they never run, and
an annotation may name a type of a module above."""

from __future__ import annotations

import ast
import os

PKG = "dflash_mp"
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", PKG)


def module_files(root: str = SRC) -> dict[str, str]:
    """Dotted module name -> file, for every .py under the package (a package is its __init__)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            if not n.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(d, n), os.path.join(root, ".."))
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = os.path.join(d, n)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                skip.update(id(n) for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: str, modules: set[str]) -> set[str]:
    """The package modules that module `name` imports (an imported name that is a submodule counts
    as the submodule)."""
    is_pkg = os.path.basename(path) == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    skip = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            # `import a.b.c` runs a, a.b and a.b.c: the deepest package module named is the edge.
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name and t != PKG:
                found.add(t)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_graph_sees_function_level_and_reexported_imports():
    graph = import_graph()
    assert "dflash_mp.data.chat" in graph["dflash_mp.data"]  # the package __init__'s re-export
    assert "dflash_mp.builtin.learned" in graph["dflash_mp.builtin.proof"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_core_modules_never_learn_builtin_names():
    """`builtin:` names are resolved at the edge: target, data, config and plan import nothing of
    dflash_mp.builtin (they receive real paths)."""
    graph = import_graph()
    core = [m for m in graph if m in ("dflash_mp.config", "dflash_mp.plan")
            or m.split(".")[:2] in (["dflash_mp", "target"], ["dflash_mp", "data"])]
    assert "dflash_mp.target.worker" in core and "dflash_mp.data.chat" in core
    leaks = {m: sorted(d for d in graph[m] if d.startswith("dflash_mp.builtin")) for m in core}
    assert not any(leaks.values()), leaks


def test_nothing_imports_the_entry_point():
    graph = import_graph()
    assert not [m for m, deps in graph.items() if "dflash_mp.main" in deps]


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every package module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_start_up_goes_down_once_the_rate_model_below_runtime_the_tool_on_top():
    """main asks the rate model (`split`) for num_target_ranks=auto; `split` knows nothing of the
    start-up, the command-line tools or the planner's report (`plan`), which sits on top of both."""
    graph = import_graph()
    assert "dflash_mp.split" in graph["dflash_mp.main"] and "dflash_mp.plan" not in reaches(graph, "dflash_mp.main")
    below = reaches(graph, "dflash_mp.split")
    assert not below & {"dflash_mp.runtime", "dflash_mp.plan", "dflash_mp.cli", "dflash_mp.main"}, below
    assert {"dflash_mp.split", "dflash_mp.runtime", "dflash_mp.cli"} <= graph["dflash_mp.plan"]


START_UP = """
import sys
import torch
import dflash_mp.main, dflash_mp.roles
from dflash_mp.compile_stats import cache_counts, counts
from dflash_mp.metrics import quiet_console
from dflash_mp.model import DFlashDrafter, DrafterArgs
from dflash_mp.model.anchors import build_blocks

quiet_console(False)
T, A, B, H = 48, 3, 4, 32
args = DrafterArgs(hidden_size=H, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, vocab_size=64, target_layer_ids=[1, 2], mask_token_id=63, block_size=B,
                   layer_types=["sliding_attention", "full_attention"], sliding_window=6)
drafter = DFlashDrafter(args)
docs = torch.cat([torch.zeros(20, dtype=torch.long), torch.ones(28, dtype=torch.long)])
pos = torch.cat([torch.arange(20), torch.arange(28)])
anchors, valid = torch.tensor([5, 12, 30]), torch.ones(3, dtype=torch.bool)
_, block_pos = build_blocks(torch.zeros(T, dtype=torch.long), pos, anchors, B, 63)
attn = drafter.build_attention(anchors, valid, docs)
assert attn.backend == "dense", attn.backend
drafter(torch.randn(T, 2 * H), torch.randn(A * B, H), pos, block_pos, attn).square().sum().backward()
assert counts()["graphs"] == 0 and cache_counts()["fx_miss"] == 0
print(sorted(m for m in ("torch._dynamo", "torch._inductor.cudagraph_trees", "datasets") if m in sys.modules))
"""


def test_a_drafter_rank_on_cpu_starts_without_dynamo_datasets_or_cuda_graph_trees():
    """What a drafter rank runs before and during an eager CPU step (the entry point and the roles
    imported, the console set, the dense mask built, a forward and backward, the compile counters read)
    imports neither Dynamo, datasets nor CUDAGraph Trees: together ~2 s of each such rank's start-up,
    two thirds of a short CPU job's processes."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", START_UP], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout

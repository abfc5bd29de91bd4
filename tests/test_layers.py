"""The import layers of src/pflalign (issue 40): every module's imports, read with `ast` (also
those inside functions, which hide a cycle from Python but not from a reader), must point down
the table below, never up or sideways, and form no cycle.

Exempt: imports under ``if TYPE_CHECKING:`` (annotations only; nothing runs them) and a module's
import of itself (run/workers.py's ``__main__`` block). A new module must be entered in `LAYERS`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pflalign"

# Bottom to top. A module may import modules of a lower layer, or of its own group; groups side by
# side in one layer do not import each other. `ALLOWED` narrows what a group may import below it.
LAYERS: list[dict[str, list[str]]] = [
    {  # the bottom: errors, adapter tensors, and the config's values (settings/ imports only errors)
        "values": ["errors", "params", "settings", "settings.*", "run", "analysis"],
    },
    {  # data (datasets as tables, partitioners, a run's clients), files and scores: no model, no method, no run
        "foundation": ["data", "data.*", "prompts", "checkpoint", "checkpoint.*", "run.run_dir", "run.client_store",
                       "model.model_cache",
                       "run_stats", "evaluate", "tensorboard", "run.allocator",
                       "optim"],  # the local optimizers' math (SGD, AdamW) and the lr schedule, below the methods
    },
    {
        "model": ["model", "model.base", "model.federated_lm", "model.build", "model.attention", "model.lora_mlp", "model.rms_norm", "model.head_loss", "model.base_cache",
                  "model.multi_lora"],  # and its CPU kernels; several adapters in one pass
        "methods": ["methods", "methods.*"],
    },
    {  # a config checked against the methods and data (config.make_method); the data cache
        "setup": ["config", "run.data_cache"],
    },
    {
        "client": ["run.client", "run.lockstep", "run.jobs", "run.workers",  # the client side, both engines
                   "run.export", "run.adapter_folder", "run.model_card",  # and the models written out
                   "run.batched_scoring"],
        "server": ["run.server"],  # the server side, both engines: the method's server rule, w^r, server state
        "lifecycle": ["run.lifecycle"],  # the run folder and its bookkeeping: needs no client code
    },
    {
        "engine": ["run.engine"],  # the two engines side by side: neither imports the other
        "flower": ["flower", "flower.*"],
        "analysis": ["analysis.runs", "analysis.stats", "analysis.tables", "analysis.report", "analysis.report_md",
                     "analysis.figures", "analysis.figure_style", "analysis.client_figures", "analysis.sweep_figure",
                     "analysis.claims"],  # beside the engines, no training code
    },
    {
        "top": ["pflalign", "__main__", "cli", "api", "commands", "sweep", "run.rescore",
                "run.together"],  # rescore, together: runs of the engine
    },
]
# report, figures and claims read run folders: they may use the bottom layer and the methods'
# names and labels, not the model, the client side or the run lifecycle (`pflalign report`
# must not load the training stack).
ALLOWED = {"analysis": {"values", "foundation", "methods"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """The pflalign modules `name` imports, with line numbers, wherever the import statement is
    (module level, functions, classes), except under ``if TYPE_CHECKING:``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def visit(node):
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "pflalign")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "pflalign":
                for alias in node.names:  # `from . import checkpoint` imports a module, not a name
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in known else target, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return sorted({(m, line) for m, line in found if m != name})


def graph() -> dict[str, list[tuple[str, int]]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def place(name: str) -> tuple[int, str] | None:
    """(layer, group) of a module `pflalign.x.y`; `x.*` entries cover a package's modules."""
    short = name.removeprefix("pflalign.") if name != "pflalign" else "pflalign"
    for layer, groups in enumerate(LAYERS):
        for group, entries in groups.items():
            for entry in entries:
                if short == entry or (entry.endswith(".*") and short.startswith(entry[:-1])):
                    return layer, group
    return None


def upward_imports(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    problems = []
    for name, targets in g.items():
        here = place(name)
        if here is None:
            problems.append(f"{name}: not in the layer table (tests/test_layers.py LAYERS)")
            continue
        for target, line in targets:
            there = place(target)
            if there is None:
                continue  # reported as that module's own problem
            same_group = there[1] == here[1]
            ok = same_group or there[0] < here[0]
            if ok and not same_group and here[1] in ALLOWED:
                ok = there[1] in ALLOWED[here[1]]
            if not ok:
                problems.append(f"{name}:{line} imports {target} "
                                f"({here[1]}, layer {here[0]} -> {there[1]}, layer {there[0]})")
    return problems


def cycles(g: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w, _ in g.get(v, []):
            if w not in g:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def test_imports_point_down_the_layers():
    problems = upward_imports(graph())
    assert not problems, "imports against the layer table:\n" + "\n".join(problems)


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layer_table_names_only_existing_modules():
    """The table stays the truth about the tree: no entry for a module that is gone."""
    shorts = {n.removeprefix("pflalign.") if n != "pflalign" else n for n in modules()}
    stale = [e for groups in LAYERS for entries in groups.values() for e in entries
             if not (e in shorts or (e.endswith(".*") and any(s.startswith(e[:-1]) for s in shorts)))]
    assert not stale, f"layer table entries without a module: {stale}"


# The folders follow the layers (README, Layout): what a folder's modules may not import, whatever
# the module-level table above allows (run/run_dir.py sits low in the table, but analysis/ reads run
# folders through checkpoint/ and run_stats.py, never through the run package).
FOLDERS_MAY_NOT_IMPORT = {
    # from the data to the clients is one path inside data/, below the config, the engines and Flower
    "pflalign.data": ("pflalign.config", "pflalign.run", "pflalign.flower", "pflalign.model", "pflalign.methods",
                      "pflalign.analysis"),
    "pflalign.model": ("pflalign.run", "pflalign.analysis", "pflalign.flower"),
    "pflalign.run": ("pflalign.analysis", "pflalign.flower"),
    "pflalign.analysis": ("pflalign.run", "pflalign.model", "pflalign.flower"),
}


def folder_crossings(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    found = []
    for name, targets in g.items():
        for folder, banned in FOLDERS_MAY_NOT_IMPORT.items():
            if name == folder or name.startswith(folder + "."):
                found += [f"{name}:{line} imports {t}" for t, line in targets
                          if any(t == b or t.startswith(b + ".") for b in banned)]
    return found


def test_folders_import_only_the_folders_below_them():
    problems = folder_crossings(graph())
    assert not problems, "imports across the folders' order:\n" + "\n".join(problems)


def test_folder_check_finds_a_crossing():
    toy = {"pflalign.analysis.report": [("pflalign.run.run_dir", 3)], "pflalign.run.engine": [("pflalign.model", 1)]}
    assert folder_crossings(toy) == ["pflalign.analysis.report:3 imports pflalign.run.run_dir"]


# ---- the checker itself, on toy graphs: it can fail --------------------------------------
def test_checker_finds_an_upward_import_and_a_hidden_cycle(tmp_path):
    g = {"pflalign.errors": [], "pflalign.settings": [("pflalign.methods", 3)], "pflalign.methods": [],
         "pflalign.analysis.report": [("pflalign.run.lifecycle", 5), ("pflalign.analysis.claims", 9)],
         "pflalign.analysis.claims": [("pflalign.analysis.report", 2)], "pflalign.run.lifecycle": []}
    problems = upward_imports(g)
    assert any(p.startswith("pflalign.settings:3 imports pflalign.methods") for p in problems)
    assert any(p.startswith("pflalign.analysis.report:5 imports pflalign.run.lifecycle") for p in problems)  # ALLOWED
    assert cycles(g) == [["pflalign.analysis.claims", "pflalign.analysis.report"]]
    # an import inside a function counts; one under TYPE_CHECKING does not
    pkg = tmp_path / "pflalign"
    pkg.mkdir()
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import X\n"
                              "def f():\n    from . import c\n")
    found = imports("pflalign.a", pkg / "a.py", {"pflalign.b", "pflalign.c"})
    assert found == [("pflalign.c", 5)]

"""Group src/pflalign's modules into subpackages that show the layers (issue 40, item 6).

Run from the repository root on a clean tree (it refuses otherwise, and on a tree already moved):

    python tools/relayout.py            # move, rewrite, verify; then review `git diff` and commit
    python tools/relayout.py --dry-run  # print what it would do, change nothing

Re-runnable on any later main: the moves are one table (`MAPPING`) and every reference is found by
reading the files, not listed by hand. What it does, in order:

1. reads every .py under src/, tests/ and benchmarks/ and works out its new text (nothing written yet):
   * imports, read with `ast`: relative ones (``from .x import``, ``from ..x import`` in data/,
     methods/, flower/, ``from . import x, y as z``) are re-resolved from the file's new package and
     stay relative; ``from pflalign import x, y`` stays absolute; a statement whose names now come
     from several packages is split into one statement per package;
   * dotted names anywhere else in the text, code, strings and comments alike: mock and
     monkeypatch targets ``"pflalign.engine.foo"``, ``-m pflalign.workers``, logger names,
     ``import pflalign.engine``, subprocess code strings;
   * paths: ``src/pflalign/engine.py``, ``pflalign/engine.py`` and a bare ``engine.py`` (not after
     ``/``, ``.``, ``-`` or a letter, so ``test_engine.py`` and ``data/partition.py`` are left alone)
     become ``src/pflalign/run/engine.py`` etc.; ``model.py`` becomes ``model/__init__.py``;
   * ``Path(__file__)`` in a module that moves one folder deeper: ``.parent`` -> ``.parents[1]``,
     ``.parents[n]`` -> ``.parents[n + 1]`` (workers.py's PYTHONPATH for its children, the source
     digests of base_cache.py and data_cache.py);
   * tests/test_layers.py's `LAYERS`: each moved module's entry renamed; the new packages'
     ``__init__`` (a docstring, no imports) entered in the bottom layer;
2. the same dotted-name and path rewriting in README.md, docs/*.md, benchmarks/README.md,
   pyproject.toml, Makefile and benchmarks/*.sh (docs/results/ and benchmarks/results/ are records
   of past runs: left as they are);
3. `git mv`s the modules (history follows them), writes the new texts and the new packages'
   ``__init__.py``;
4. verifies: every .py compiles, every ``pflalign`` import names a module that exists, no old
   dotted name is left, and every module under src/pflalign imports in a fresh interpreter
   (modules whose third-party dependency is missing, e.g. flwr, are reported as skipped).

Prints each move and, per file, how many imports, dotted names and paths it rewrote. Stdlib only.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

# old module (under pflalign) -> new module. Every name keeps its last part, so `engine.run` stays
# `run` and only the package in front changes. A module missing from the tree is skipped (`server`:
# added by other work; mapped so that a re-run after it merges moves it too).
MAPPING = {
    # the model and what only it runs: its CPU training kernels and its caches. model.py becomes
    # model/__init__.py, so `pflalign.model.FederatedLM` and every `from .model import` keep working.
    "model": "model",
    "attention": "model.attention",
    "lora_mlp": "model.lora_mlp",
    "rms_norm": "model.rms_norm",
    "head_loss": "model.head_loss",
    "base_cache": "model.base_cache",
    "model_cache": "model.model_cache",
    # one run, for both engines: the client side, the server side, the in-process engine, the run's
    # lifecycle, its folder, its per-client files, its data cache and its outputs (export), and the
    # process's allocator (the engine and the workers hand memory back through it)
    "client": "run.client",
    "server": "run.server",
    "workers": "run.workers",
    "engine": "run.engine",
    "lifecycle": "run.lifecycle",
    "client_store": "run.client_store",
    "run_dir": "run.run_dir",
    "data_cache": "run.data_cache",
    "export": "run.export",
    "allocator": "run.allocator",
    # finished runs read back: no training code (tests/test_layers.py ALLOWED)
    "report": "analysis.report",
    "report_md": "analysis.report_md",
    "figures": "analysis.figures",
    "claims": "analysis.claims",
}
# Left at the top, on purpose: checkpoint.py (the run folder's crash-safe files) is imported by the
# model's caches and by report, so inside run/ the model folder and analysis/ would import the run
# folder; run_stats.py is shared by lifecycle and report (below both). The rest at the top is
# either the bottom (errors, params, settings, prompts, optim, evaluate, tensorboard), the setup
# (config, partition) or the top (cli, api, commands, sweep, __main__).

# The new packages' __init__.py: a docstring only, so importing `pflalign.run.allocator` (the
# command does, before it loads torch) loads nothing else.
PACKAGES = {
    "model": None,  # model.py's own text
    "run": ("One run, for both engines: {run_parts}. The Flower engine (pflalign.flower) uses the same "
            "client side{server_too} and lifecycle.",
            "No imports here: `pflalign.run.allocator` must load without torch (allocator.py says why)."),
    "analysis": ("Finished runs read back: {analysis_modules}. They import no training code (tests/test_layers.py), "
                 "so `pflalign report` does not load the training stack.",),
}
RUN_PARTS = [("the client side", ["client", "workers"]), ("the server side", ["server"]),
             ("the in-process engine", ["engine"]),
             ("the run's lifecycle and files", ["lifecycle", "client_store", "run_dir", "data_cache", "export"]),
             ("the process's memory allocator", ["allocator"])]


def package_docstring(package: str, present: set[str]) -> str:
    """The docstring of a new package's __init__.py, naming the modules it holds in this tree."""
    files = lambda ms: ", ".join(f"{m}.py" for m in ms if m in present)  # noqa: E731
    parts = [f"{what} ({files(ms)})" for what, ms in RUN_PARTS if files(ms)]
    fields = {"run_parts": ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts),
              "server_too": ", server side" if "server" in present else "",
              "analysis_modules": files(m for m in MAPPING if MAPPING[m].startswith("analysis."))}
    paragraphs = [textwrap.fill(p.format(**fields), 100) for p in PACKAGES[package]]
    return '"""' + "\n\n".join(paragraphs) + '\n"""\n'


ROOT = Path.cwd()
PKG = ROOT / "src" / "pflalign"
PY_ROOTS = ["src", "tests", "benchmarks"]
TEXT_FILES = ["README.md", "docs/*.md", "benchmarks/README.md", "pyproject.toml", "Makefile", "benchmarks/*.sh"]
SELF = Path(__file__).resolve()


# ---- the tree ------------------------------------------------------------------------------------
def old_modules() -> dict[str, Path]:
    """module name under pflalign ('' for the package, 'data.load', ...) -> file."""
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def new_file(new: str) -> Path:
    """The file of module `new` after the move: a new package's own module is its __init__.py."""
    return PKG.joinpath(*new.split("."), "__init__.py") if new in PACKAGES else PKG.joinpath(*new.split(".")).with_suffix(".py")


def rename(mod: str) -> str:
    """New name of module `mod` (under pflalign); modules not in MAPPING keep theirs."""
    return MAPPING.get(mod, mod)


def full(short: str) -> str:
    return "pflalign" + (f".{short}" if short else "")


def package_of(mod: str, is_init: bool) -> str:
    return mod if is_init else mod.rpartition(".")[0]


# ---- text positions ------------------------------------------------------------------------------
class Text:
    """A file's text with ast's (line, byte column) positions turned into string offsets."""

    def __init__(self, text: str):
        self.text = text
        self.starts = [0]
        for line in text.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))
        self.lines = text.splitlines(keepends=True)

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1] if lineno - 1 < len(self.lines) else ""
        return self.starts[lineno - 1] + len(line.encode()[:col].decode())


def apply(text: str, edits: list[tuple[int, int, str]], gap) -> str:
    """`edits` (start, end, replacement) in place; `gap(s)` rewrites the text between them."""
    out, pos = [], 0
    for start, end, new in sorted(edits):
        out.append(gap(text[pos:start]))
        out.append(new)
        pos = end
    out.append(gap(text[pos:]))
    return "".join(out)


# ---- imports -------------------------------------------------------------------------------------
def relative(target: str, package: str) -> str:
    """`target` (full dotted) as seen from `package` (full dotted): '.', '..model', '.client'."""
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return "." * (len(p) - common + 1) + ".".join(t[common:])


def import_edits(src: Text, tree: ast.AST, mod_old: str | None, is_init: bool, mods: set[str],
                 notes: list[str]) -> list[tuple[int, int, str]]:
    """Edits for every `from ... import` that reaches into pflalign. `mod_old`: the file's module
    under pflalign (None for a file outside the package: tests, benchmarks)."""
    edits = []
    mod_new = rename(mod_old) if mod_old is not None else None
    pkg_old = full(package_of(mod_old, is_init)) if mod_old is not None else None
    pkg_new = full(package_of(mod_new, is_init or mod_new in PACKAGES)) if mod_new is not None else None
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if pkg_old is None:
                continue
            base = pkg_old.split(".")[:len(pkg_old.split(".")) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source != "pflalign" and not source.startswith("pflalign."):
            continue
        short = source.removeprefix("pflalign").removeprefix(".")
        if short not in mods:
            notes.append(f"line {node.lineno}: from {source} import ...: no such module (left as it is)")
            continue
        groups: dict[str, list[str]] = {}
        for alias in node.names:
            name = alias.name + (f" as {alias.asname}" if alias.asname else "")
            sub = f"{short}.{alias.name}" if short else alias.name
            if alias.name != "*" and sub in mods:  # a module: it goes where its module goes
                new_sub = rename(sub)
                where = full(new_sub.rpartition(".")[0])
                assert new_sub.rpartition(".")[2] == alias.name, (sub, new_sub)
            else:  # a name defined in module `short`
                where = full(rename(short))
            groups.setdefault(where, []).append(name)
        spelled = {where: (relative(where, pkg_new) if node.level else where) for where in groups}
        start = src.offset(node.lineno, node.col_offset)
        end = src.offset(node.end_lineno, node.end_col_offset)
        segment = src.text[start:end]
        head = re.match(r"from\s+(\.+\s*[\w.]*|[\w.]+)\s+import\b", segment)
        assert head, segment
        if len(groups) == 1:
            (where,) = groups
            new_head = f"from {spelled[where]} import"
            if head.group(0) != new_head:
                edits.append((start, start + head.end(), new_head))
            continue
        # names from several packages now: one statement per package, in the original's place
        line_start = src.starts[node.lineno - 1]
        before = src.text[line_start:start]
        comments = re.findall(r"#[^\n]*", segment)
        statements = [wrap(f"from {spelled[w]} import ", names) for w, names in groups.items()]
        if before.strip():  # `if x: from . import a, b`: keep it one line
            new = "; ".join(s.replace("\n", " ") for s in statements)
        else:
            new = ("\n" + before).join(s.replace("\n", "\n" + before) for s in statements)
        if comments:
            new += "  " + "  ".join(comments)
            notes.append(f"line {node.lineno}: split; its comments follow the last statement")
        edits.append((start, end, new))
    return edits


def wrap(head: str, names: list[str], width: int = 110) -> str:
    line = head + ", ".join(names)
    if len(line) <= width:
        return line
    lines, current = [], head + "("
    for i, name in enumerate(names):
        piece = name + ("," if i < len(names) - 1 else ")")
        if len(current) + len(piece) > width and current.strip() and not current.endswith("("):  # not before a first name
            lines.append(current.rstrip())
            current = " " * len(head + "(")
        current += piece + " "
    lines.append(current.rstrip())
    return "\n".join(lines)


# ---- dotted names, paths, __file__ ---------------------------------------------------------------
def dotted_pattern(mods: set[str]) -> re.Pattern | None:
    moved = sorted((m for m in mods if m in MAPPING and MAPPING[m] != m), key=len, reverse=True)
    if not moved:
        return None
    return re.compile(r"(?<![\w.])pflalign\.(" + "|".join(re.escape(m) for m in moved) + r")(?![\w])")


def path_pattern(moves: dict[str, str]) -> re.Pattern | None:
    """`moves`: old file path under src/pflalign -> new one (posix)."""
    if not moves:
        return None
    olds = sorted(moves, key=len, reverse=True)
    return re.compile(r"(?<![\w./-])((?:src/)?pflalign/)?(" + "|".join(re.escape(o) for o in olds) + r")(?![\w])")


FROM_PACKAGE = re.compile(r"(?<![\w.])from pflalign import (\w+(?: as \w+)?(?:, *\w+(?: as \w+)?)*)")


def from_package(m: re.Match) -> str:
    """`from pflalign import a, b as c` outside an import statement (a string of code): one
    statement per package, joined by "; "."""
    groups: dict[str, list[str]] = {}
    for name in re.split(r", *", m.group(1)):
        new = MAPPING.get(name.split(" as ")[0], "")
        groups.setdefault(full(new.rpartition(".")[0]), []).append(name)
    return "; ".join(f"from {where} import {', '.join(names)}" for where, names in groups.items())


class Rewriter:
    def __init__(self, mods: set[str], moves: dict[str, str]):
        self.dotted = dotted_pattern(mods)
        self.paths = path_pattern(moves)
        self.moves = moves

    def __call__(self, text: str, counts: dict[str, int]) -> str:
        def package_import(m):  # in code strings: `python -c "from pflalign import x"`
            new = from_package(m)
            counts["dotted"] += new != m.group(0)
            return new

        text = FROM_PACKAGE.sub(package_import, text)
        if self.dotted:
            text, n = self.dotted.subn(lambda m: "pflalign." + MAPPING[m.group(1)], text)
            counts["dotted"] += n
        if self.paths:
            text, n = self.paths.subn(lambda m: (m.group(1) or "") + self.moves[m.group(2)], text)
            counts["paths"] += n
        return text


FILE_PARENTS = re.compile(r"(Path\(__file__\)(?:\.resolve\(\))?)\.(parents\[(\d+)\]|parent(?![\w\[]))")


def deepen_file_paths(text: str, by: int, counts: dict[str, int]) -> str:
    """`Path(__file__)...parent(s)` in a module whose file moved `by` folders deeper."""
    def sub(m):
        n = int(m.group(3)) if m.group(3) is not None else 0
        counts["__file__"] += 1
        return f"{m.group(1)}.parents[{n + by}]"
    return FILE_PARENTS.sub(sub, text) if by else text


def layer_table_edits(src: Text, tree: ast.AST, new_packages: list[str]) -> list[tuple[int, int, str]]:
    """tests/test_layers.py: rename the moved modules' entries in LAYERS; enter the new packages."""
    edits = []
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if not (isinstance(target, ast.Name) and target.id == "LAYERS"):
            continue
        entries = [e for lst in ast.walk(node.value) if isinstance(lst, ast.List) for e in lst.elts]  # not the group names
        for const in entries:
            if isinstance(const, ast.Constant) and isinstance(const.value, str) and const.value in MAPPING \
                    and MAPPING[const.value] != const.value:
                start = src.offset(const.lineno, const.col_offset)
                end = src.offset(const.end_lineno, const.end_col_offset)
                quote = src.text[start]
                edits.append((start, end, f"{quote}{MAPPING[const.value]}{quote}"))
        bottom = node.value.elts[0].values[0]  # the first group of the bottom layer
        if new_packages and isinstance(bottom, ast.List):
            end = src.offset(bottom.end_lineno, bottom.end_col_offset) - 1  # before its ]
            edits.append((end, end, "".join(f', "{p}"' for p in new_packages)))
        return edits
    raise SystemExit("tests/test_layers.py: no LAYERS table found")


# ---- checks after the move -----------------------------------------------------------------------
def check_imports(files: list[Path], mods: set[str]) -> list[str]:
    """Every `from pflalign... import` / relative import must name an existing module."""
    problems = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        mod, is_init = None, False
        if path.is_relative_to(PKG):
            parts = list(path.relative_to(PKG).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            mod = ".".join(parts[:-1] if is_init else parts)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = full(package_of(mod, is_init)).split(".")
                    source = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                names = [source]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.split(".")[0] == "pflalign" and name.removeprefix("pflalign").removeprefix(".") not in mods:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {name}, which does not exist")
    return problems


IMPORT_ALL = r"""
import importlib, json, sys
failed, skipped = {}, {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        (failed if (exc.name or "").startswith("pflalign") else skipped)[name] = repr(exc)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps({"failed": failed, "skipped": skipped}))
"""


def import_every_module(mods: set[str]) -> tuple[dict, dict]:
    names = sorted(full(m) for m in mods if m != "__main__")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(names)], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    if done.returncode != 0:
        return {"(interpreter)": done.stderr[-2000:]}, {}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["failed"], out["skipped"]


# ---- main ----------------------------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print what would change; write nothing")
    ap.add_argument("--skip-import-check", action="store_true",
                    help="do not import every module afterwards (the slow check: torch, transformers)")
    args = ap.parse_args(argv)

    if not (ROOT / "pyproject.toml").is_file() or not PKG.is_dir():
        raise SystemExit("run this from the repository root (no pyproject.toml or src/pflalign here)")
    already = [p for p in PACKAGES if (PKG / p / "__init__.py").exists()]
    if already:
        raise SystemExit(f"already moved: src/pflalign/{already[0]}/__init__.py exists; nothing done")
    if git("status", "--porcelain", "--untracked-files=no"):
        raise SystemExit("the tree has uncommitted changes: commit or stash them first (the move must be "
                         "one reviewable diff); nothing done")

    olds = old_modules()
    present = {m for m in MAPPING if m in olds}
    for m in sorted(set(MAPPING) - present):
        print(f"skip: pflalign.{m} is not in this tree")
    for m, new in MAPPING.items():
        if m in present and new_file(new).exists():
            raise SystemExit(f"{new_file(new).relative_to(ROOT)} exists already; nothing done")
    new_mods = {rename(m) for m in olds} | {p for p in PACKAGES}
    new_packages = [p for p in PACKAGES if p not in present]  # packages that are new modules
    file_moves = {}  # old path under src/pflalign -> new path (posix), for every module whose file moves
    for m in present:
        old_rel = olds[m].relative_to(PKG).as_posix()
        new_rel = new_file(rename(m)).relative_to(PKG).as_posix()
        if old_rel != new_rel:
            file_moves[old_rel] = new_rel
    rewrite = Rewriter(set(olds), file_moves)

    # 1. the new texts, keyed by the file's new path
    py_files = sorted(p for r in PY_ROOTS for p in (ROOT / r).rglob("*.py")
                      if p.resolve() != SELF and ".venv" not in p.parts and "__pycache__" not in p.parts)
    new_texts: dict[Path, str] = {}
    report = []
    for path in py_files:
        text = path.read_text()
        src = Text(text)
        tree = ast.parse(text, str(path))
        mod, is_init, dest = None, False, path
        if path.is_relative_to(PKG):
            parts = list(path.relative_to(PKG).with_suffix("").parts)
            is_init = parts[-1] == "__init__"
            mod = ".".join(parts[:-1] if is_init else parts)
            if mod in present:
                dest = new_file(rename(mod))
        counts = {"imports": 0, "dotted": 0, "paths": 0, "__file__": 0, "LAYERS": 0}
        notes: list[str] = []
        edits = import_edits(src, tree, mod, is_init, set(olds), notes)
        counts["imports"] = len(edits)
        if path == ROOT / "tests" / "test_layers.py":
            table = layer_table_edits(src, tree, new_packages)
            counts["LAYERS"] = len(table)
            edits += table
        new = apply(text, edits, lambda s: rewrite(s, counts))
        by = len(dest.relative_to(PKG).parts) - len(path.relative_to(PKG).parts) if path.is_relative_to(PKG) else 0
        new = deepen_file_paths(new, by, counts)
        if new != text or dest != path:
            new_texts[dest] = new
            what = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
            report.append(f"  {path.relative_to(ROOT)}" + (f" -> {dest.relative_to(ROOT)}" if dest != path else "")
                          + (f": {what}" if what else ""))
            report.extend(f"      {n}" for n in notes)
    doc_files = sorted({p for pattern in TEXT_FILES for p in ROOT.glob(pattern) if p.is_file()})
    for path in doc_files:
        text = path.read_text()
        counts = {"dotted": 0, "paths": 0}
        new = rewrite(text, counts)
        if new != text:
            new_texts[path] = new
            report.append(f"  {path.relative_to(ROOT)}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))

    # package docstrings for the packages that are new modules
    inits = {PKG / p / "__init__.py": package_docstring(p, present) for p in new_packages}

    print("moves:")
    for m in sorted(present, key=lambda m: rename(m)):
        if olds[m] != new_file(rename(m)):
            print(f"  git mv {olds[m].relative_to(ROOT)} {new_file(rename(m)).relative_to(ROOT)}")
    for path in inits:
        print(f"  new    {path.relative_to(ROOT)}")
    print("rewrites:")
    print("\n".join(report))
    if args.dry_run:
        print("dry run: nothing written")
        return 0

    # 2. move, write
    for m in sorted(present):
        dest = new_file(rename(m))
        if olds[m] != dest:
            dest.parent.mkdir(parents=True, exist_ok=True)
            git("mv", str(olds[m].relative_to(ROOT)), str(dest.relative_to(ROOT)))
    for path, text in {**new_texts, **inits}.items():
        path.write_text(text)
    git("add", *[str(p.relative_to(ROOT)) for p in inits])

    # 3. verify
    problems = []
    all_py = sorted(p for r in PY_ROOTS for p in (ROOT / r).rglob("*.py")
                    if p.resolve() != SELF and ".venv" not in p.parts and "__pycache__" not in p.parts)
    for path in all_py:
        try:
            compile(path.read_text(), str(path), "exec")
        except SyntaxError as exc:
            problems.append(f"{path.relative_to(ROOT)}: does not compile: {exc}")
    after = old_modules()
    if set(after) != new_mods:
        problems.append(f"modules after the move differ from the plan: {sorted(set(after) ^ new_mods)}")
    problems += check_imports(all_py, set(after))
    left = dotted_pattern(set(olds))
    if left:
        for path in all_py + doc_files:
            for i, line in enumerate(path.read_text().splitlines(), 1):
                for m in left.finditer(line):
                    problems.append(f"{path.relative_to(ROOT)}:{i}: still names pflalign.{m.group(1)}")
    for path in all_py + doc_files:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for m in FROM_PACKAGE.finditer(line):
                if from_package(m) != m.group(0):
                    problems.append(f"{path.relative_to(ROOT)}:{i}: still {m.group(0)!r}")
    if not args.skip_import_check:
        failed, skipped = import_every_module(set(after))
        problems += [f"import {name}: {err}" for name, err in failed.items()]
        for name, err in skipped.items():
            print(f"import check skipped {name}: {err} (a dependency not installed here)")
    print(f"verified: {len(all_py)} .py files compile; {len(after)} modules"
          + ("" if args.skip_import_check else ", each imported in a fresh interpreter"))
    if problems:
        print("PROBLEMS:\n" + "\n".join(f"  {p}" for p in problems))
        print("undo with: git reset --hard (the moves are staged, the new __init__.py files added)")
        return 1
    print("done: review `git diff --cached -M` and `git diff`, then commit (git add -A)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The shape of the code base: the wire formats import no JAX, imports run one way down the
layers (docs/architecture.md), and the docs name only paths that exist."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import colibri.protocol

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "colibri"
# Each part of colibri and its layer: a module may import its own layer and those below.
LAYERS = {
    **dict.fromkeys(
        [
            "config",
            "checkpoint",
            "weights",
            "tokenizer",
            "kernels",
            "hugepages",
            "jaxcache",
            "files",
            "formats",
        ],
        0,
    ),
    **dict.fromkeys(["synth", "gguf", "memlimit"], 0),
    **dict.fromkeys(["model", "training"], 1),
    "experts": 2,
    "engine": 3,
    **dict.fromkeys(["serve", "analysis", "routing_stats"], 4),
    **dict.fromkeys(["client", "widgets", "gateway", "chat", "atlas", "report", "bench"], 5),
    "cli": 6,
}
DOC_PAGES = ["protocol", "design", "architecture", "kernels", "benchmarks"]


def part(module: str) -> str:
    """`colibri.engine.runner` -> `engine`; `colibri` itself -> `colibri`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "colibri"


def imports_of(path: Path) -> set[str]:
    """Every colibri module a file imports, at any depth (function bodies included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("colibri"):
            if node.module == "colibri":  # `from colibri import kernels`
                found |= {f"colibri.{a.name}" for a in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("colibri")}
    return found


def test_every_part_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    parts -= {"__init__", "__pycache__", "protocol"}
    assert parts <= set(LAYERS), parts - set(LAYERS)


def test_no_module_imports_upward():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        mine = part(module)
        for target in imports_of(path):
            theirs = part(target)
            if mine == "protocol":
                ok = theirs == "protocol"  # the wire formats stand alone
            elif theirs in ("protocol", mine) or mine == "colibri":
                ok = True
            else:
                ok = LAYERS[theirs] <= LAYERS[mine]
            if not ok:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_only_experiments_import_the_bench_helpers():
    """colibri.bench serves the scripts in experiments/ and their tests: no other part of
    colibri imports it."""
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if part(module) != "bench":
            wrong += [f"{module} imports {t}" for t in imports_of(path) if part(t) == "bench"]
    assert wrong == []


# Calls that load a file as a module (importlib, runpy).
LOADERS = {"spec_from_file_location", "SourceFileLoader", "exec_module", "load_module", "run_path"}


def script_problems(path: Path, scripts: set[str]) -> list[str]:
    """What ties a script in experiments/ to another: importing it, touching sys.path, or
    loading a file as a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or "."] if node.level == 0 else ["."]
            if node.module == "sys" and any(a.name == "path" for a in node.names):
                found.append("imports sys.path")
        found += [f"imports {n}" for n in names if n.split(".")[0] in scripts or n == "."]
        if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
            found.append("uses sys.path")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in LOADERS:
                found.append(f"calls {ast.unparse(func)}")
    return [f"{path.name}: {f}" for f in found]


def test_experiments_stand_alone():
    """Every script in experiments/ imports only colibri (colibri.bench for what scripts share)
    and third-party packages: none imports another script, edits sys.path or loads a file
    through importlib."""
    paths = sorted((REPO / "experiments").glob("*.py"))
    scripts = {p.stem for p in paths}
    assert {"bench_peers", "atlas"} <= scripts
    problems = [f for p in paths for f in script_problems(p, scripts)]
    assert problems == []


def test_the_wire_formats_import_no_jax():
    modules = [m.name for m in pkgutil.iter_modules(colibri.protocol.__path__, "colibri.protocol.")]
    assert "colibri.protocol.codec" in modules and "colibri.protocol.legacy" in modules
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_gateway_imports_no_jax():
    """The gateway only talks to an engine process: JAX there would cost ~150 MB of RSS."""
    code = "import sys, colibri.gateway.server, colibri.gateway.app\nprint('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_docs_and_a_short_readme():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
    for page in DOC_PAGES:
        assert (REPO / "docs" / f"{page}.md").is_file(), page


def test_every_path_a_doc_names_exists():
    """Backticked paths under the repository's own folders, and relative links, in README.md
    and docs/*.md."""
    tops = {p.name for p in REPO.iterdir()} - {".git"}
    missing = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for path in re.findall(r"`([A-Za-z0-9_.*/-]+)`", text):
            head = path.split("/")[0]
            if "/" in path and head in tops and not list(REPO.glob(path.rstrip("/"))):
                missing.append(f"{doc.name}: {path}")
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            if not (doc.parent / link).exists():
                missing.append(f"{doc.name}: link {link}")
    assert missing == []


def test_the_public_api_resolves_and_loads_lazily():
    code = (
        "import sys, colibri\n"
        "light = 'jax' not in sys.modules and 'numpy' not in sys.modules\n"
        "names = [n for n in colibri.__all__ if getattr(colibri, n) is not None]\n"
        "print(light, len(names) == len(colibri.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]

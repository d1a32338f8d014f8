"""Dependencies point down: peer -> (p2p, blocks); p2p and blocks never import each other or peer;
client and server never import each other, nor the API (which sits on the client and never imports
the server). Checked on the source, and by importing each module alone."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import bloompeer

PACKAGE_DIR = Path(bloompeer.__file__).parent
MODULES = sorted(
    ".".join(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE_DIR.rglob("*.py") if path.name != "__main__.py"
)
FORBIDDEN = {
    "bloompeer.errors": ("bloompeer.blocks", "bloompeer.p2p", "bloompeer.peer"),  # the roots every room imports
    "bloompeer.weight_format": ("bloompeer.blocks", "bloompeer.p2p", "bloompeer.peer"),
    "bloompeer.blocks": ("bloompeer.p2p", "bloompeer.peer"),
    "bloompeer.p2p": ("bloompeer.blocks", "bloompeer.peer"),
    "bloompeer.peer.client": ("bloompeer.peer.server", "bloompeer.peer.api", "bloompeer.peer.cli"),
    "bloompeer.peer.server": ("bloompeer.peer.client", "bloompeer.peer.api", "bloompeer.peer.cli"),
    "bloompeer.peer.api": ("bloompeer.peer.server", "bloompeer.peer.cli"),  # a client of the swarm, as generate is
}


def _imports(module: str) -> set[str]:
    path = PACKAGE_DIR.parent / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            found.add(base)
    return found


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down(module):
    for layer, forbidden in FORBIDDEN.items():
        if module == layer or module.startswith(layer + "."):
            bad = {name for name in _imports(module) if any(name == room or name.startswith(room + ".")
                                                            for room in forbidden)}
            assert not bad, f"{module} imports {bad}"


def test_every_module_imports_alone():
    """No circular imports: each module can be the first bloompeer module imported.

    One interpreter, with bloompeer's modules dropped from sys.modules before each import
    (third-party packages stay loaded, which keeps this fast)."""
    script = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    for name in [n for n in sys.modules if n == 'bloompeer' or n.startswith('bloompeer.')]:\n"
        "        del sys.modules[name]\n"
        "    importlib.import_module(m)\n"
    )
    subprocess.run([sys.executable, "-c", script, *MODULES], check=True, timeout=300)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the bloompeer modules it imports anywhere in its source, function bodies included
    (an import hidden in a function still ties the two modules together)."""
    known = set(MODULES)
    graph = {}
    for module in MODULES:
        targets = set()
        for name in _imports(module):
            while name and name not in known:  # `from pkg.mod import name` names pkg.mod
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def test_no_import_circle_anywhere():
    graph, state, path = _import_graph(), {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                circle = path[path.index(target):] + [target]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module)


def test_nothing_below_the_command_line_imports_it():
    """peer/cli/ assembles the commands from client, server and api; a module below importing it
    back would tie every command to every other (and their flags to the request path)."""
    def in_cli(module: str) -> bool:
        return module == "bloompeer.peer.cli" or module.startswith("bloompeer.peer.cli.")

    importers = [module for module, targets in _import_graph().items()
                 if not in_cli(module) and any(in_cli(target) for target in targets)]
    assert importers == []


def test_no_command_modules_outside_the_command_line_room():
    """The command modules live in peer/cli/; the top of peer/ holds only its rooms (and what they share)."""
    top = sorted(path.stem for path in (PACKAGE_DIR / "peer").glob("*.py") if path.stem != "__init__")
    assert not [name for name in top if name.endswith(("_command", "cli")) or name in ("flags", "arguments")], top


@pytest.mark.parametrize("module", [m for m in MODULES if m.startswith("bloompeer.peer.")])
def test_peer_does_not_speak_to_hivemind_streams(module):
    """Streams, their timeouts and their failures are p2p/'s business (p2p/streams.py): peer/ never
    imports hivemind's networking, it uses the names bloompeer.p2p exports."""
    bad = {name for name in _imports(module) if name.startswith(("hivemind.p2p", "hivemind.dht"))}
    assert not bad, f"{module} imports {bad}"


def test_peer_opens_no_stream_itself():
    """Every stream a server or client of peer/ opens, and every handler it registers, goes through
    p2p/streams.py (which bounds its waits and translates its failures)."""
    calls = ("call_binary_stream_handler", "add_binary_stream_handler", "remove_binary_stream_handler")
    openers = sorted(str(path.relative_to(PACKAGE_DIR)) for path in (PACKAGE_DIR / "peer").rglob("*.py")
                     if any(call in path.read_text() for call in calls))
    assert openers == []


def test_servers_import_none_of_transformers_model_code():
    """A server needs BloomConfig, not transformers' modeling: `modeling_utils` drags in
    torch._dynamo and generation, seconds of CPU before a local swarm's servers can start."""
    heavy = {"transformers.modeling_utils", "transformers.models.bloom.modeling_bloom", "torch._dynamo"}
    script = ("import sys; from bloompeer.peer.server import server; from bloompeer.peer.cli import serve_command\n"
              f"print(sorted({heavy!r} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], check=True, timeout=300, capture_output=True, text=True)
    assert result.stdout.strip() == "[]", f"a server imports {result.stdout.strip()}"

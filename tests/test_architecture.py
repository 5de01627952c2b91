"""The shape of the package, checked on its source (ast): no import cycle, no backend reaching into
another module's private names or, directly or through any chain of imports, into another backend."""

import ast
import pathlib

import pytest

import unsloth_adaptive_kl

PACKAGE = pathlib.Path(unsloth_adaptive_kl.__file__).parent
NAME = "unsloth_adaptive_kl"
BACKENDS = ("trl", "unsloth", "liger")  # each patches or supplies one library's loss
#: The one module that joins two backends, by design: GRPOTrainer(loss_class=...) is TRL's trainer
#: with its loss from the Liger module. What it may reach, and the chains through it, are checked apart.
BRIDGE, BRIDGED = f"{NAME}.backends.loss_class", f"{NAME}.backends.liger"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports(name: str):
    """Every import of a package module in ``name`` (function-local ones too), as
    ``(imported module, imported names or None, node)``. ``from . import x`` is the module ``x``
    where one exists."""
    tree = ast.parse(MODULES[name].read_text())
    here = name if is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == NAME:
                    yield alias.name, None, node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == NAME:
                source = node.module
            else:
                continue
            plain = []
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    yield f"{source}.{alias.name}", None, node
                else:
                    plain.append(alias.name)
            if plain:
                yield source, plain, node


def graph() -> dict[str, set[str]]:
    return {name: {target for target, _, _ in imports(name) if target in MODULES and target != name} for name in MODULES}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` (a depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_sees_relative_and_lazy_imports_and_finds_a_cycle():
    edges = graph()
    assert f"{NAME}.backends._trainer" in edges[f"{NAME}.backends.trl"]  # `from . import _trainer`
    assert f"{NAME}.backends._config_class" in edges[f"{NAME}.doctor"]  # imported inside a function of doctor.py
    # The circle this package had: trl.py imported unsloth.py lazily, and unsloth.py imported trl.py.
    old = {**edges, f"{NAME}.backends.trl": edges[f"{NAME}.backends.trl"] | {f"{NAME}.backends.unsloth"}}
    old[f"{NAME}.backends.unsloth"] = old[f"{NAME}.backends.unsloth"] | {f"{NAME}.backends.trl"}
    assert find_cycle(old) is not None


def checked_modules():
    return [name for name in MODULES if name.startswith(f"{NAME}.backends.") or name == f"{NAME}.doctor"]


def test_no_backend_or_doctor_imports_a_private_name_of_another_module():
    for name in checked_modules():
        module_aliases = {}
        for target, names, node in imports(name):
            if names is None:
                for alias in node.names:
                    module_aliases[alias.asname or alias.name] = target
                continue
            private = [n for n in names if n.startswith("_") and not n.endswith("__")]
            assert not private, f"{name} imports private {private} from {target}"
        tree = ast.parse(MODULES[name].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_"):
                if node.value.id in module_aliases and not node.attr.startswith("__"):
                    raise AssertionError(f"{name} reads {node.value.id}.{node.attr} (private) of {module_aliases[node.value.id]}")


def reached(edges: dict[str, set[str]], start: str, stop: str | None = BRIDGE) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others (lazy imports included), with one chain
    that leads there; ``stop`` is reached but not followed."""
    chains = {start: [start]}
    todo = [start]
    while todo:
        node = todo.pop()
        if node == stop:
            continue
        for nxt in sorted(edges.get(node, ())):
            if nxt not in chains:
                chains[nxt] = chains[node] + [nxt]
                todo.append(nxt)
    return chains


def backend_violations(edges) -> list[str]:
    found = []
    for backend in BACKENDS:
        name = f"{NAME}.backends.{backend}"
        chains = reached(edges, name)
        found += [" -> ".join(chains[f"{NAME}.backends.{other}"]) for other in BACKENDS if other != backend and f"{NAME}.backends.{other}" in chains]
    bridge = reached(edges, BRIDGE, stop=None)
    found += [" -> ".join(bridge[f"{NAME}.backends.{b}"]) for b in BACKENDS if f"{NAME}.backends.{b}" in bridge and f"{NAME}.backends.{b}" != BRIDGED]
    return found


def test_no_backend_imports_another_backend_even_through_other_modules():
    assert backend_violations(graph()) == []


def test_the_backend_check_follows_chains_of_imports():
    edges = graph()
    # _trainer.py (which trl.py imports) reaching unsloth.py would make trl.py import it, one step removed.
    edges = {**edges, f"{NAME}.backends._trainer": edges[f"{NAME}.backends._trainer"] | {f"{NAME}.backends.unsloth"}}
    assert f"{NAME}.backends.trl -> {NAME}.backends._trainer -> {NAME}.backends.unsloth" in backend_violations(edges)


def test_the_trainer_side_state_is_the_kl_term_and_the_controller():
    """``AdaptiveKL`` holds the KL term and the controller, and no copy of a setting it never reads
    (it had ``use_bias_correction_kl``: the importance ratio is the backend's ``coef`` argument)."""
    import types

    from unsloth_adaptive_kl import AdaptiveKL, KLTerm
    from unsloth_adaptive_kl.config import DEFAULTS

    state = AdaptiveKL(types.SimpleNamespace(**DEFAULTS, beta=0.1, use_bias_correction_kl=True))
    assert isinstance(state.term, KLTerm) and state.controller.beta == 0.1
    assert not hasattr(state, "use_bias_correction_kl")
    # the cross-process sum (and this process's slot in it), the step's sums, the tail metrics' logging window, a warn-once flag
    own = set(vars(state)) - {"reduce", "process_index", "num_processes", "_step_sums", "_tail_window", "_warned_nonfinite"}
    # monitor, monitor_every (kl_monitor, kl_monitor_every): whether, and on which batches, the KL is computed at β = 0;
    # alarm: the runaway alarm (runaway.py), fed each optimizer step; course: what β did over this train() (BetaCourse),
    # for the one line said when it ends
    assert own == {"term", "controller", "monitor", "monitor_every", "alarm", "course"}, own


def test_backends_reach_the_length_normalised_term_only_through_kl_term():
    """The length-normalised KL loss has one call site pattern: ``KLTerm.length_normalized_loss``.
    No backend imports ``shaping.length_normalized_term`` itself (the Liger module did)."""
    offenders = [
        f"{name}:{node.lineno}"
        for name in MODULES
        if name.startswith(f"{NAME}.backends")
        for source, names, node in imports(name)
        if source == f"{NAME}.shaping" and names and "length_normalized_term" in names
    ]
    assert offenders == []


def documented_modules() -> set[str]:
    """The modules docs/architecture.md lists in its tree under "## The modules", as paths in the package."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("## The modules", 1)[1].split("```", 2)[1]
    listed, folder = set(), ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        name = line.strip().split(" ")[0] if line.strip() else ""
        if indent == 2 and name.endswith("/"):
            folder = name
        elif indent == 2 and name.endswith(".py"):
            listed.add(name)
        elif indent == 4 and name.endswith(".py"):
            listed.add(folder + name)
    return listed


def test_the_architecture_page_lists_every_module_and_no_other():
    modules = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")}
    listed = documented_modules()
    assert modules - listed == set(), f"docs/architecture.md does not list {sorted(modules - listed)}"
    assert listed - modules == set(), f"docs/architecture.md lists modules that do not exist: {sorted(listed - modules)}"


# -- layers: every import goes to the module's own layer or one below ---------------------------------------------
def layers() -> dict[str, int]:
    """Module (dotted name) -> layer number, from the block under "## Layers" of docs/architecture.md: lines
    ``N name  file.py ...`` and their continuation lines; ``backends/`` stands for every module under it."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    found, layer = {}, None
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0].isdigit():
            layer, words = int(words[0]), words[2:]
        for word in words:
            if word.endswith("/"):
                found.update({name: layer for name in MODULES if name.startswith(f"{NAME}.{word[:-1]}.") or name == f"{NAME}.{word[:-1]}"})
            else:
                found[module_name(PACKAGE / word)] = layer
    return found


def upward_imports(edges: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    return [
        f"{name} (layer {layer_of[name]}) imports {target} (layer {layer_of[target]})"
        for name, targets in sorted(edges.items())
        for target in sorted(targets)
        if layer_of[target] > layer_of[name]
    ]


def test_every_module_is_in_one_layer():
    layer_of = layers()
    assert set(layer_of) == set(MODULES), f"not in a layer: {sorted(set(MODULES) - set(layer_of))}; unknown: {sorted(set(layer_of) - set(MODULES))}"


def test_no_import_goes_from_a_lower_layer_up_to_a_higher_one():
    assert upward_imports(graph(), layers()) == []


def test_the_layer_check_finds_an_upward_import_lazy_ones_included():
    """The import the issue found: the per-token math (kl_term.py) reading the config validator; and one inside a
    function (``def f(): from .config import validate``), which the graph reads as any other."""
    edges = graph()
    old = {**edges, f"{NAME}.kl_term": edges[f"{NAME}.kl_term"] | {f"{NAME}.config"}}
    assert upward_imports(old, layers()) == [f"{NAME}.kl_term (layer 3) imports {NAME}.config (layer 4)"]
    tree = ast.parse("def f():\n    from .config import validate\n")
    assert any(isinstance(node, ast.ImportFrom) and node.module == "config" for node in ast.walk(tree))  # what imports() walks
    assert f"{NAME}.backends._config_class" in edges[f"{NAME}.doctor"]  # a lazy import (inside a function) is an edge


def test_the_cycle_check_finds_the_registration_cycle_that_config_py_worked_around():
    """target_controller.py imports the controller base; were the base (not controllers.py, which registers the
    built-ins) to import it back, that would be a cycle: config.py imported it to register it before issue 54."""
    edges = graph()
    assert f"{NAME}.target_controller" in edges[f"{NAME}.controllers"]  # registered by controllers.py
    assert f"{NAME}.target_controller" not in edges[f"{NAME}.config"]
    cyclic = {**edges, f"{NAME}.controller_base": edges[f"{NAME}.controller_base"] | {f"{NAME}.target_controller"}}
    assert find_cycle(cyclic) is not None


def test_no_package_module_is_over_400_lines():
    """Every module of the package, backends included (before issue 54 the backends were exempt: _trainer.py had 537
    lines, unsloth.py 515)."""
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}, long


def config_entries(config) -> list[str]:
    """The calls into a function of config.py from another file while one AdaptiveKL is built from ``config``."""
    import sys

    from unsloth_adaptive_kl import AdaptiveKL, config as config_module

    here, calls = config_module.__file__, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == here and frame.f_back is not None and frame.f_back.f_code.co_filename != here:
            calls.append(f"{pathlib.Path(frame.f_back.f_code.co_filename).name} -> {frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        AdaptiveKL(config)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("method", ["none", "first_controller"])
def test_building_an_adaptive_kl_enters_config_py_once(method):
    """docs/architecture.md ("Validation once"): ``config.build`` is the one entry (it was 6 calls from kl_term.py
    and adaptation.py)."""
    import types

    from unsloth_adaptive_kl.config import DEFAULTS
    from unsloth_adaptive_kl.controllers import controller_names

    method = controller_names()[0] if method == "first_controller" else method
    config = types.SimpleNamespace(**{**DEFAULTS, "kl_adaptation_method": method}, beta=0.1)
    assert config_entries(config) == ["adaptation.py -> build"]
    assert "enters `config.py` once" in (PACKAGE.parent / "docs" / "architecture.md").read_text()

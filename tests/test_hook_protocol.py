"""The hook protocol (``backends/hooks.py``) against every rewrite string of every plan, read with ``ast``.

Every attribute a rewrite reads on one of this package's objects (``self._adaptive_kl``, ``trainer._adaptive_kl``,
``kwargs["adaptive_kl"]``, TRL's local ``adaptive_kl``) must be declared on that object's protocol, each protocol
method must be called by some rewrite (no dead declaration), and each runtime class must implement its protocol with
the same parameters. The plans are found by walking the backends' modules, so a new plan is checked without being
listed here."""

import ast
import importlib
import inspect
import pkgutil
import textwrap

import pytest

import unsloth_adaptive_kl.backends as backends_package
from unsloth_adaptive_kl._source_patch import Plan
from unsloth_adaptive_kl.backends import hooks
from unsloth_adaptive_kl.backends.trl import TRLAdaptiveKL
from unsloth_adaptive_kl.backends.unsloth import FusedKLInputs, UnslothAdaptiveKL
from unsloth_adaptive_kl.kl_pipeline import TokenKL

#: protocol -> the class that implements it
IMPLEMENTATIONS = {
    hooks.TRLLossHooks: TRLAdaptiveKL,
    hooks.UnslothTrainerHooks: UnslothAdaptiveKL,
    hooks.FusedLossHooks: FusedKLInputs,
    hooks.TokenKLHooks: TokenKL,
}


def plans() -> dict[str, Plan]:
    """Every module-level Plan of the backends (name -> plan)."""
    found = {}
    for info in pkgutil.iter_modules(backends_package.__path__):
        module = importlib.import_module(f"{backends_package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, Plan):
                found.setdefault(id(value), (f"{info.name}.{name}", value))  # a plan re-exported by another module: once
    return dict(found.values())


def rewrites():
    """(plan name, anchor set family, rewrite) for every rewrite of every anchor set of every plan."""
    return [(name, anchor_set.family, rewrite) for name, plan in plans().items() for anchor_set in plan.anchor_sets for rewrite in anchor_set.rewrites]


def parse_fragment(text: str) -> ast.AST:
    """A replacement is a fragment of a function: statements, possibly opening with the ``else:`` of a block before it
    or ending with a block header whose body follows in the library's source, or the arguments of a call. Parsed as the
    first of these that is valid Python."""
    source = textwrap.dedent(text)
    last = source.rstrip("\n").splitlines()[-1]
    body = " " * (len(last) - len(last.lstrip()) + 4) + "pass\n"
    opening = "if _:\n    pass\n"
    candidates = (source, source + body, opening + source, opening + source + body, f"f(\n{source})\n")
    for candidate in candidates:
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    raise AssertionError(f"a replacement that is no Python fragment:\n{text}")


def protocol_of(root: str, rewrite) -> type:
    if root == "fused":
        return hooks.FusedLossHooks
    if root == "token_kl":
        return hooks.TokenKLHooks
    if rewrite.library == "trl":
        return hooks.TRLLossHooks if rewrite.target.endswith("._compute_loss") else hooks.GenerationHooks
    return hooks.UnslothTrainerHooks


def root_of(node: ast.AST) -> str | None:
    """Which of the package's objects ``node`` is: the runtime, the fused loss's inputs, TRL's TokenKL, or None."""
    if isinstance(node, ast.Attribute) and node.attr == "_adaptive_kl" and isinstance(node.value, ast.Name):
        return "runtime"
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "adaptive_kl":
        return "fused"
    if isinstance(node, ast.Name) and node.id == "adaptive_kl":
        return "token_kl"
    return None


def calls(rewrite) -> list[tuple[type, str]]:
    """(protocol, attribute) for every attribute the replacement reads on one of the package's objects."""
    found = []
    for node in ast.walk(parse_fragment(rewrite.replacement)):
        if isinstance(node, ast.Attribute) and (root := root_of(node.value)) is not None:
            found.append((protocol_of(root, rewrite), node.attr))
        if isinstance(node, ast.Name) and node.id.startswith("adaptive_kl") and node.id != "adaptive_kl":
            continue  # locals the rewrites make (adaptive_kl_i, adaptive_kl_penalty, ...): tensors, read by no attribute
    return found


def declared(protocol: type, name: str) -> bool:
    return any(name in vars(cls) or name in getattr(cls, "__annotations__", {}) for cls in protocol.__mro__ if cls is not object)


def undeclared(rewrite_list) -> list[str]:
    return [
        f"{plan}[{family}] {rewrite.target}: {protocol.__name__} has no {name!r}"
        for plan, family, rewrite in rewrite_list
        for protocol, name in calls(rewrite)
        if not declared(protocol, name)
    ]


def test_every_plan_of_every_backend_is_read():
    names = set(plans())
    # TRL's loss and generation, Unsloth's fused loss and its generation, the reward placement on both libraries
    # (unsloth.py re-exports unsloth_plan.py's plans: each is read once, under the first module's name)
    assert {"trl.PLAN", "unsloth.PLAN", "unsloth.MONITOR_PLAN", "reward_placement.TRL_PLAN", "reward_placement.UNSLOTH_PLAN"} <= names
    assert len(names) == 5, names
    families = {family for _, family, _ in rewrites()}
    assert {"unsloth 2026.8", "unsloth 2026.9", "unsloth 2026.10", "trl 1.8", "trl 0.24"} <= families


def test_every_name_a_rewrite_calls_is_declared_on_its_protocol():
    assert undeclared(rewrites()) == []


def test_the_check_sees_an_undeclared_call():
    """The call the TRL rewrite made before the protocol (``computes_kl_with``, ``term.kl_mask``), and the fused loss's
    ``term.shape``, are each caught."""
    from unsloth_adaptive_kl._source_patch import Rewrite

    old = Rewrite(
        "GRPOTrainer._compute_loss", "trl", "x\n",
        '        if self._adaptive_kl.computes_kl_with(inputs.get("ref_per_token_logps")):\n'
        '            adaptive_kl_mask = self._adaptive_kl.term.kl_mask(mask, inputs["completion_ids"])\n'
        '        adaptive_kl_i = kwargs["adaptive_kl"].term.shape(kl_i)\n',
        "the old form",
    )  # fmt: skip
    found = undeclared([("old", "old", old)])
    assert sorted(found) == sorted([
        "old[old] GRPOTrainer._compute_loss: TRLLossHooks has no 'computes_kl_with'",
        "old[old] GRPOTrainer._compute_loss: TRLLossHooks has no 'term'",
        "old[old] GRPOTrainer._compute_loss: FusedLossHooks has no 'term'",
    ])


def protocol_methods(protocol: type) -> set[str]:
    return {
        name for cls in protocol.__mro__ if cls not in (object,) and cls.__module__ == hooks.__name__
        for name, value in vars(cls).items() if callable(value) and not name.startswith("_")
    }  # fmt: skip


def test_every_protocol_method_is_called_by_some_rewrite():
    called = {}
    for _, _, rewrite in rewrites():
        for protocol, name in calls(rewrite):
            called.setdefault(protocol, set()).add(name)
    for protocol in IMPLEMENTATIONS:
        own = {name for name in vars(protocol) if callable(vars(protocol)[name]) and not name.startswith("_")}
        assert own <= called.get(protocol, set()) | {n for p, names in called.items() if protocol in p.__mro__ for n in names}, protocol


@pytest.mark.parametrize("protocol", list(IMPLEMENTATIONS), ids=lambda p: p.__name__)
def test_each_runtime_class_implements_its_protocol_with_the_same_parameters(protocol):
    implementation = IMPLEMENTATIONS[protocol]
    for name in sorted(protocol_methods(protocol)):
        assert hasattr(implementation, name), f"{implementation.__qualname__} lacks {name}"
        expected = [(p.name, p.kind) for p in inspect.signature(getattr(protocol, name)).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(implementation, name)).parameters.values()]
        assert got == expected, f"{implementation.__qualname__}.{name}{got} differs from {protocol.__name__}.{name}{expected}"
    for name in getattr(protocol, "__annotations__", {}):
        assert name in getattr(implementation, "__dataclass_fields__", {}) or hasattr(implementation, name), name


def test_calls_with_many_arguments_are_keyword_calls():
    """A hook called with more than three arguments names them (the fused loss's ``finish`` took 9 positionally)."""
    long_positional = []
    for plan, family, rewrite in rewrites():
        for node in ast.walk(parse_fragment(rewrite.replacement)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and root_of(node.func.value) and len(node.args) > 3:
                long_positional.append(f"{plan}[{family}] {node.func.attr}: {len(node.args)} positional")
    assert long_positional == []

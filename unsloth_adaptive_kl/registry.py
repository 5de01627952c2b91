"""The one registry the three share (KL estimators, shaping methods, β controllers): a dict of name to entry, with
the claim of a name and its parameters, unregistration, and the ordered queries every module reads.

An entry is a frozen record (``EstimatorSpec``, ``ShapingMethod``, ``ControllerSpec``) with at least ``name``,
``builtin`` and ``parameters``. Shaping methods and β controllers share the names of ``kl_adaptation_method``
(:func:`~unsloth_adaptive_kl.declarations.claim_method_part`); estimators have their own names, with aliases. Each
registry module keeps its decorator (what it checks of a function or class is its own) and calls
:meth:`Registry.claim`, :meth:`Registry.add` and :meth:`Registry.remove`. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from .declarations import Parameter, claim_method_part, declare, release_method_part, undeclare


class Registry(dict):
    """Name -> entry of one ``kind`` ("KL estimator", "shaping method", "β controller"): a dict, as each registry was
    before it (register and unregister through :meth:`claim`, :meth:`add` and :meth:`remove`, which keep the names
    and the parameters' declarations consistent; a test may still set an entry with ``monkeypatch.setitem``).

    ``order``: the sort key of an entry for :meth:`names` (None: registration order). ``method_names``: the names
    are parts of ``kl_adaptation_method``, one namespace with the other registry of such parts; otherwise the
    registry has its own names (and may have aliases), each checked by ``check_name`` (raises ValueError)."""

    def __init__(self, kind: str, *, order: Callable | None = None, method_names: bool = False, check_name: Callable[[str], None] | None = None):
        super().__init__()
        self.kind = kind
        self._order = order
        self._method_names = method_names
        self._check_name = check_name
        self._aliases: dict[str, str] = {}  # alias -> name (aliases are not keys)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self)})"

    # -- registration ----------------------------------------------------------------------------------------
    def claim(self, name: str, parameters: tuple[Parameter, ...] = (), aliases: tuple[str, ...] = ()) -> None:
        """Reserve ``name`` (and ``aliases``) and declare ``parameters`` for it: all of it, or nothing (ValueError)."""
        if self._method_names:
            if aliases:
                raise ValueError(f"{self.kind} {name!r}: a part of kl_adaptation_method has no aliases")
            claim_method_part(self.kind, name, tuple(parameters))
            return
        for key in (name, *aliases):
            if key in self or key in self._aliases:
                raise ValueError(f"{self.kind} {key!r} is already registered")
            if self._check_name is not None:
                self._check_name(key)
        declare(self.kind, name, tuple(parameters))

    def add(self, entry, aliases: tuple[str, ...] = ()) -> None:
        """Store ``entry`` under its name (already claimed with :meth:`claim`) and its ``aliases``."""
        self[entry.name] = entry
        for alias in aliases:
            self._aliases[alias] = entry.name

    def remove(self, name: str) -> None:
        """Unregister the user entry ``name`` (or an alias of it), its aliases and its parameters' declarations;
        ValueError naming what is allowed for a built-in or an unknown name."""
        entry = self.resolve(name)
        if entry is None or entry.builtin:
            noun = self.kind.split()[-1]
            raise ValueError(f"{self.kind} {name!r} is not a registered user {noun}; allowed: {list(self.user_names())}")
        del self[entry.name]
        for alias in self.aliases(entry.name):
            del self._aliases[alias]
        if self._method_names:
            release_method_part(self.kind, entry.name)
        else:
            undeclare(self.kind, entry.name)

    # -- queries ---------------------------------------------------------------------------------------------
    def resolve(self, name: str):
        """The entry registered as ``name`` or with it as an alias; None if there is none."""
        return self.get(self._aliases.get(name, name))

    def aliases(self, name: str) -> tuple[str, ...]:
        """The other names of ``name``, sorted."""
        return tuple(sorted(alias for alias, target in self._aliases.items() if target == name))

    def all_aliases(self) -> tuple[str, ...]:
        return tuple(self._aliases)

    def names(self) -> tuple[str, ...]:
        """Every registered name (no alias), in the registry's order."""
        entries = self.values() if self._order is None else sorted(self.values(), key=self._order)
        return tuple(entry.name for entry in entries)

    def builtin_names(self) -> tuple[str, ...]:
        return tuple(name for name in self.names() if self[name].builtin)

    def user_names(self) -> tuple[str, ...]:
        return tuple(name for name in self.names() if not self[name].builtin)

    def readers(self, builtin: bool | None = None) -> dict[str, tuple[str, ...]]:
        """Each declared parameter's name -> the entries that declare it, in the registry's order (``builtin``: only the
        built-ins or only the users')."""
        out: dict[str, list[str]] = {}
        for name in self.names():
            if builtin is None or self[name].builtin == builtin:
                for parameter in self[name].parameters:
                    out.setdefault(parameter.name, []).append(name)
        return {parameter: tuple(names) for parameter, names in out.items()}

    def parameters(self, builtin: bool | None = None) -> tuple[Parameter, ...]:
        """Every parameter the entries declare, once, in the registry's order (``builtin``: only the built-ins' or
        only the users')."""
        seen: dict[str, Parameter] = {}
        for name in self.names():
            entry = self[name]
            if builtin is None or entry.builtin == builtin:
                for parameter in entry.parameters:
                    seen.setdefault(parameter.name, parameter)
        return tuple(seen.values())

"""The adaptive-KL fields that ``trl.GRPOConfig`` gains, with defaults, help text and validation.

This module does not import TRL: it describes the fields; ``backends/_trainer.py`` grafts them
onto the config class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .controllers import CONTROLLERS, ControllerConfig, controller_names, controller_parameters
from .declarations import Parameter, check_parameter, checked_beta, checked_number, yaml_hint  # noqa: F401  (checked_beta: a name of this module's API)
from .estimators import ESTIMATORS, builtin_estimator_names, estimator_aliases, estimator_parameters, get_estimator
from .kl_term import KLTerm
from .method import NO_CONTROLLER, Method, parse_method
from .shaping import SHAPING, shaping_names, shaping_parameters


@dataclass(frozen=True)
class FieldSpec:
    name: str
    type: type
    default: object
    help: str


def registered_parameters(builtin: bool | None = None) -> tuple[Parameter, ...]:
    """Every parameter the three registries declare, once: the estimators', the shaping methods', the β controllers'
    (``builtin``: only the built-ins', which are ``GRPOConfig`` fields, or only those registered later)."""
    seen: dict[str, Parameter] = {}
    for parameter in (*estimator_parameters(builtin), *shaping_parameters(builtin), *controller_parameters(builtin)):
        seen.setdefault(parameter.name, parameter)
    return tuple(seen.values())


def _estimator_words() -> str:
    return ", ".join(
        name + (f" ({', '.join(aliases)})" if (aliases := estimator_aliases(name)) else "") for name in builtin_estimator_names()
    )


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "kl_adaptation_method",
        str,
        "none",
        f"How the KL term is adapted: 'none', one of {list(shaping_names())} (shaping, applied in that order), "
        f"{list(controller_names())} (β controllers), or a '+'-joined combination of at most one β controller and any "
        "shaping methods, e.g. 'dynamic+length_normalized'; or a method registered with "
        "unsloth_adaptive_kl.register_shaping or unsloth_adaptive_kl.register_controller.",
    ),
    FieldSpec(
        "kl_estimator",
        str,
        "k3",
        f"Per-token KL estimator, by registered name: {_estimator_words()}, or one registered with "
        "unsloth_adaptive_kl.register_estimator.",
    ),
    # the built-in estimators', shaping methods' and β controllers' parameters, as their registries declare them
    *(FieldSpec(p.name, p.type, p.default, p.help) for p in registered_parameters(builtin=True)),
    FieldSpec(
        "kl_shaping_kwargs",
        dict | str | None,
        None,
        "The parameters of the shaping methods, β controllers and estimators registered with "
        "unsloth_adaptive_kl.register_shaping, register_controller or register_estimator, by name: a dict "
        "(a mapping in YAML, JSON on the command line), e.g. {\"huber_delta\": 0.5}; unset ones take their defaults.",
    ),
    FieldSpec(
        "restart_beta_controller",
        bool,
        False,
        "On resume (resume_from_checkpoint), start the β controller fresh from beta instead of restoring its state "
        "(β, reward window) from the checkpoint; needed to resume with another β controller than the checkpoint's "
        "(e.g. 'none' -> 'dynamic').",
    ),
    FieldSpec(
        "kl_monitor",
        bool,
        False,
        "With beta = 0 (set, or reached by a β controller), still run the reference forward and compute and log "
        "the KL (adaptive_kl/* and TRL's kl), while the loss stays exactly the backend's beta = 0 loss. Costs the reference "
        "forward (on the generation batches kl_monitor_every selects). With kl_placement='reward' the KL is measured at "
        "scoring as that placement measures it, and the rewards are left as they are (beta * KL = 0). TRL (>= 1.8; >= 1.9 "
        "with kl_placement='reward') and Unsloth 2026.10; refused on Unsloth 2026.8/2026.9 and with GRPOTrainer(loss_class=...).",
    ),
    FieldSpec(
        "kl_monitor_every",
        int,
        16,
        "With kl_monitor=True: at beta = 0 the reference forward runs on every kl_monitor_every-th generation batch of "
        "training (the first included; with TRL's defaults one batch is one optimizer step), and only those steps log "
        "the KL. 1: every batch (the full monitor, ~1.3-1.5x a stock beta = 0 step); the default 16 costs about 1/16 of "
        "that. Evaluation batches are always monitored. See docs/metrics-tail.md.",
    ),
    FieldSpec(
        "kl_exclude_token_ids",
        list[int] | None,
        None,
        "Token ids (a list of non-negative integers) whose completion positions get no KL term, in the loss and in "
        "the KL metrics; the policy term is untouched. E.g. [tokenizer.eos_token_id]: EOS and chat-template tokens "
        "carry far more KL than content tokens.",
    ),
    FieldSpec(
        "liger_fused_head",
        str,
        "auto",
        "GRPOTrainer(loss_class=AdaptiveFusedLinearGRPOLoss) only: the fused LM head (gradient in the forward, 3 GEMMs "
        "instead of 4). 'auto': wherever it is exact (else TRL's log-prob kernel); true: required (a call where it is "
        "not exact warns with the reason); false: never.",
    ),
    FieldSpec(
        "kl_placement",
        str,
        "loss",
        "Where β·KL acts: 'loss' (TRL's place: β times the per-token KL is added to the loss) or 'reward' (each "
        "completion's reward is lowered by β times the sum over its tokens of the per-token KL, measured when the "
        "completions are scored, before the group normalisation of the advantages; the loss then has no KL term; at beta = 0 only with "
        "kl_monitor=True, which watches that KL and leaves the rewards as they are). See docs/kl-placement.md.",
    ),
)

FIELD_NAMES = tuple(f.name for f in FIELDS)
#: The built-in registries' parameters: each is a field; a registered function's are in ``kl_shaping_kwargs``.
PARAMETER_FIELDS = tuple(p.name for p in registered_parameters(builtin=True))
#: The built-in shaping methods' parameters (fields).
SHAPING_FIELDS = tuple(p.name for p in shaping_parameters(builtin=True))
#: The fields a KL term (``kl_term.KLTerm``) reads; the rest configure the β controller.
TERM_FIELD_NAMES = (
    "kl_adaptation_method", "kl_estimator", *SHAPING_FIELDS, *(p.name for p in estimator_parameters(builtin=True)),
    "kl_shaping_kwargs", "kl_exclude_token_ids",
)  # fmt: skip
#: Each field's default, declared once (above): the controllers, the Liger module and the docs read it here.
DEFAULTS = {f.name: f.default for f in FIELDS}


def _require(condition: bool, name: str, value, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{name}={value!r} is not valid; allowed: {allowed}")


def fused_head_setting(value, name: str = "liger_fused_head", *, text: bool = True):
    """The Liger module's ``fused_head`` (``"auto"``, True or False) for ``value``: those, or, with ``text``
    (a config field: a command line gives strings), the strings ``"true"``/``"false"``; ValueError
    otherwise. The one check of a ``fused_head`` value (the Liger module's keyword calls it with ``text=False``)."""
    if isinstance(value, bool) or value == "auto":
        return value
    if text and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    true, false = ("true", "false") if text else ("True", "False")
    raise ValueError(
        f"{name}={value!r} is not valid; allowed: 'auto' (the fused LM head wherever it is exact, the default), {true} "
        f"(required: a call where it is not exact warns with the reason) or {false} (TRL's log-prob kernel)"
    )


def excluded_token_ids(value, name: str = "kl_exclude_token_ids") -> tuple[int, ...]:
    """``kl_exclude_token_ids`` as a sorted tuple without repeats (None: empty); ValueError naming the field,
    the value and what is allowed for anything but a list (or tuple) of non-negative ints."""
    if value is None:
        return ()
    valid = isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    _require(valid, name, value, "a list of non-negative integer token ids, e.g. [tokenizer.eos_token_id], or None")
    return tuple(sorted(set(value)))


def shaping_kwargs(config) -> dict:
    """``config.kl_shaping_kwargs`` as a dict (None: empty; a string: its JSON), its keys checked: the parameters of
    the functions registered after import (those of the built-ins are fields)."""
    value = getattr(config, "kl_shaping_kwargs", None)
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"kl_shaping_kwargs={value!r} is not valid; allowed: a dict, or its JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"kl_shaping_kwargs={value!r} is not valid; allowed: a dict of parameters of registered functions")
    registered = [p.name for p in registered_parameters() if p.name not in PARAMETER_FIELDS]
    unknown = [key for key in value if key not in registered]
    if unknown:
        fields = [key for key in unknown if key in PARAMETER_FIELDS]
        hint = f" ({fields}: set as fields of GRPOConfig)" if fields else ""
        raise ValueError(f"kl_shaping_kwargs has unknown key(s) {unknown}{hint}; allowed: the parameters of registered functions {registered}")
    return value


def parameter_values(config, parameters: tuple[Parameter, ...]) -> dict[str, object]:
    """The value of each of ``parameters`` (checked): a built-in's from its field, a registered function's from
    ``kl_shaping_kwargs`` (its default when not set there). Name -> value."""
    given = shaping_kwargs(config)
    bounds = {"beta": getattr(config, "beta", None)}
    values = {}
    for parameter in parameters:
        if parameter.name in PARAMETER_FIELDS:
            values[parameter.name] = check_parameter(parameter, getattr(config, parameter.name), bounds=bounds)
        else:
            label = f"kl_shaping_kwargs[{parameter.name!r}]"
            values[parameter.name] = check_parameter(parameter, given.get(parameter.name, parameter.default), label=label, bounds=bounds)
    return values


def controller_config(config, method: Method) -> ControllerConfig:
    """β and the β controllers' settings of ``config``: every built-in controller parameter (fields), and the
    registered ones of ``method``'s controller or set in ``kl_shaping_kwargs``."""
    given = shaping_kwargs(config)
    wanted = {p.name: p for p in controller_parameters(builtin=True)}
    wanted.update({p.name: p for p in method.controller_parameters})
    wanted.update({p.name: p for p in controller_parameters(builtin=False) if p.name in given})
    values = parameter_values(config, tuple(wanted.values()))
    return ControllerConfig(beta=config.beta, kl_monitor=getattr(config, "kl_monitor", False) is True, **values)


@dataclass(frozen=True)
class Settings:
    """What the runtime (:class:`~unsloth_adaptive_kl.adaptation.AdaptiveKL`) needs from a config, made by :func:`build`:
    the KL term, the β controller's settings, and whether (and on which generation batches) ``kl_monitor`` logs the KL
    at β = 0."""

    term: KLTerm
    controller: ControllerConfig
    monitor: bool
    monitor_every: int
    #: the fields set that nothing of this run reads (:func:`unread_settings`): the runtime warns of each
    unread: tuple[tuple[str, object, str], ...] = ()


def build(config) -> Settings:
    """Validate ``config`` (any object with the adaptive-KL fields and ``beta``, a ``GRPOConfig``) once, with
    :func:`validate`, and make from it what the runtime needs. The one way from a config to a KL term: the KL term
    (``kl_term.py``, the per-token math) reads no config. Raises ValueError naming the field, the value and what is
    allowed."""
    method = validate(config)
    estimator = get_estimator(config.kl_estimator)
    values = parameter_values(config, (*estimator.parameters, *method.parameters))
    term = KLTerm(
        method=method,
        estimator=estimator.name,
        estimator_parameters=tuple((p.name, values[p.name]) for p in estimator.parameters),
        shaping_parameters=tuple((p.name, values[p.name]) for p in method.parameters),
        exclude_token_ids=excluded_token_ids(config.kl_exclude_token_ids),
        placement=config.kl_placement,
    )
    return Settings(term, controller_config(config, method), config.kl_monitor, monitor_every(config),
                    tuple(unread_settings(config, method)))


#: The three registries whose entries read parameters, by the kind :func:`parameter_readers` names them with.
READER_KINDS = (("shaping", SHAPING), ("controller", CONTROLLERS), ("estimator", ESTIMATORS))


def parameter_readers(builtin: bool | None = None) -> dict[str, list[tuple[str, str]]]:
    """Each registered parameter's readers: ``(kind, name)`` of the shaping methods, β controllers and estimators that
    declare it, in that order, each kind in its registry's order (``builtin``: only the built-ins or only the users')."""
    readers: dict[str, list[tuple[str, str]]] = {}
    for kind, registry in READER_KINDS:
        for parameter, names in registry.readers(builtin).items():
            readers.setdefault(parameter, []).extend((kind, name) for name in names)
    return readers


def unread_settings(config, method: Method) -> list[tuple[str, object, str]]:
    """The settings of ``config`` set to other than their default that nothing it trains with reads: ``(field, value,
    why)``, ``why`` in words. A value a user set for a method not chosen has no effect:

    - a built-in parameter (a field) that neither ``method``'s shaping steps, nor its β controller, nor its estimator
      reads, with the methods and estimators that would (:func:`parameter_readers`);
    - a key of ``kl_shaping_kwargs`` (a registered function's parameter) that none of them reads;
    - ``kl_monitor`` (and ``kl_monitor_every``) under a fixed β > 0: it acts only at β = 0, which no controller reaches.
    (``liger_fused_head`` depends on the backend: the trainer warns of it, ``backends/_trainer.py``.)"""
    estimator = get_estimator(config.kl_estimator)
    read = {p.name for p in (*method.parameters, *method.controller_parameters, *estimator.parameters)}
    readers = parameter_readers()
    words = f"kl_adaptation_method={config.kl_adaptation_method!r} with kl_estimator={config.kl_estimator!r} does not read it"

    def read_by(name: str) -> str:
        names = [f"kl_estimator={n!r}" if kind == "estimator" else repr(n) for kind, n in readers.get(name, ())]
        return f"{words} (read by {', '.join(names) or 'no built-in'})"

    unread = [(p.name, getattr(config, p.name), read_by(p.name)) for p in registered_parameters(builtin=True)
              if p.name not in read and hasattr(config, p.name) and getattr(config, p.name) != p.default]
    unread += [(f"kl_shaping_kwargs[{name!r}]", value, read_by(name)) for name, value in shaping_kwargs(config).items() if name not in read]
    if method.controller == NO_CONTROLLER and config.beta != 0:
        why = (f"it logs the KL at steps where beta = 0, and beta={config.beta!r} is fixed (kl_adaptation_method="
               f"{config.kl_adaptation_method!r} has no β controller), unless it is set to 0 by hand (trainer.beta = 0)")
        unread += [(name, getattr(config, name), why) for name in ("kl_monitor", "kl_monitor_every")
                   if getattr(config, name, DEFAULTS[name]) != DEFAULTS[name]]
    return unread


def validate(config) -> Method:
    """Check the adaptive-KL fields of ``config`` (any object with them as attributes): the grammar of the method, and
    every parameter against its registry's declaration.

    Returns the parsed method. Raises ValueError naming the field, the value and what is allowed.
    """
    missing = [name for name in FIELD_NAMES if not hasattr(config, name)]
    if missing:
        raise ValueError(
            f"{type(config).__name__} has no adaptive-KL field(s) {missing}: its class is not one unsloth_adaptive_kl "
            "patched (trl.GRPOConfig, or Unsloth's UnslothGRPOConfig). Create the config from trl.GRPOConfig after "
            "`import unsloth_adaptive_kl`"
        )
    method = parse_method(config.kl_adaptation_method)
    get_estimator(config.kl_estimator)
    _require(isinstance(config.restart_beta_controller, bool), "restart_beta_controller", config.restart_beta_controller, "true or false")
    _require(isinstance(config.kl_monitor, bool), "kl_monitor", config.kl_monitor, "true or false")
    monitor_every(config)
    excluded_token_ids(config.kl_exclude_token_ids)
    beta = checked_beta(config.beta)
    given = shaping_kwargs(config)
    # every built-in parameter (a field) whatever the method; a registered one where the method reads it, or set
    read = (*method.parameters, *method.controller_parameters, *get_estimator(config.kl_estimator).parameters)
    parameter_values(config, tuple(p for p in registered_parameters() if p.name in PARAMETER_FIELDS or p.name in given or p in read))
    if method.controller in CONTROLLERS:
        CONTROLLERS[method.controller].cls.check_settings(controller_config(config, method))
    fused_head_setting(config.liger_fused_head)
    if method.is_none and beta == 0 and not config.kl_monitor:  # no KL term, none computed: a KL setting does nothing
        if get_estimator(config.kl_estimator).name != DEFAULTS["kl_estimator"]:
            raise ValueError(
                f"kl_estimator={config.kl_estimator!r} is not valid with beta=0.0: beta=0 removes the KL term (and TRL's "
                f"default beta is 0.0), so the estimator would never act; allowed: beta > 0, kl_monitor=True (the KL is "
                f"logged), or kl_estimator={DEFAULTS['kl_estimator']!r}"
            )
        if excluded_token_ids(config.kl_exclude_token_ids):
            raise ValueError(
                f"kl_exclude_token_ids={config.kl_exclude_token_ids!r} is not valid with beta=0.0: beta=0 removes the KL "
                "term (and TRL's default beta is 0.0), so no token's KL would be left out of anything; allowed: beta > 0, "
                "kl_monitor=True (the KL is logged, without those tokens), or kl_exclude_token_ids=None"
            )
    if not method.is_none and beta == 0:
        raise ValueError(
            f"beta=0.0 is not valid with kl_adaptation_method={config.kl_adaptation_method!r}: that method acts on "
            "the KL term, which beta=0 removes; allowed: beta > 0, or kl_adaptation_method='none'"
        )
    check_placement(config.kl_placement, method, beta, monitor=config.kl_monitor)
    return method


def monitor_every(config) -> int:
    """``config.kl_monitor_every`` (checked): an integer >= 1, and other than its default only with ``kl_monitor=True``
    (without it the value would select nothing, silently). ValueError naming the field, the value and what is allowed."""
    value = getattr(config, "kl_monitor_every", DEFAULTS["kl_monitor_every"])
    valid = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    _require(valid, "kl_monitor_every", value, "an integer >= 1 (1: every generation batch; the default 16: one in 16)")
    if value != DEFAULTS["kl_monitor_every"] and getattr(config, "kl_monitor", False) is not True:
        raise ValueError(
            f"kl_monitor_every={value!r} is not valid with kl_monitor=False: it chooses the steps whose KL kl_monitor logs at "
            f"beta = 0; allowed: kl_monitor=True, or kl_monitor_every={DEFAULTS['kl_monitor_every']} (the default)"
        )
    return value


#: ``kl_placement``'s values: where β·KL acts (docs/kl-placement.md).
PLACEMENTS = ("loss", "reward")


def check_placement(placement, method: Method, beta, *, monitor: bool = False) -> str:
    """``placement`` if it is a valid ``kl_placement`` for ``method``, ``beta`` and ``kl_monitor`` (``monitor``);
    ValueError otherwise. "reward" at β = 0 needs ``kl_monitor`` (the KL is watched, the reward untouched).

    In the reward every per-token shaping step applies (it shapes the KL summed into the penalty), and
    ``length_normalized`` makes the penalty a per-completion mean instead of a sum; a shaping step that
    acts on the loss's aggregation in another way has no meaning there and is refused by name."""
    _require(placement in PLACEMENTS, "kl_placement", placement, f"one of {list(PLACEMENTS)}")
    if placement == "reward":
        if beta == 0 and not monitor:
            raise ValueError(
                "kl_placement='reward' is not valid with beta=0.0: the reward is lowered by beta times the KL, which "
                "beta=0 removes (and TRL then computes no reference log-probs); allowed: beta > 0, kl_monitor=True (the "
                "KL is computed and logged, the reward left as it is), or kl_placement='loss'"
            )
        for name in method.shaping:
            if not SHAPING[name].per_token and name != "length_normalized":
                raise ValueError(
                    f"kl_placement='reward' is not valid with the shaping method {name!r}: it acts on the loss's "
                    "aggregation of the KL, which the reward placement does not have (the penalty is a sum over each "
                    "completion's tokens); allowed: per-token shaping methods and length_normalized, or kl_placement='loss'"
                )
    return placement

"""The adaptive-KL fields that ``trl.GRPOConfig`` gains, with defaults, help text and validation.

This module does not import TRL: it describes the fields; ``backends/_trainer.py`` grafts them
onto the config class.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .estimators import get_estimator
from .shaping import CONTROLLERS, SHAPING, Method, Parameter, parse_method, shaping_names, shaping_parameters


@dataclass(frozen=True)
class FieldSpec:
    name: str
    type: type
    default: object
    help: str


FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "kl_adaptation_method",
        str,
        "none",
        f"How the KL term is adapted: 'none', one of {list(shaping_names())} (shaping, applied in that order), "
        f"{list(CONTROLLERS)} (β controllers), or a '+'-joined combination of at most one β controller and any "
        "shaping methods, e.g. 'dynamic+length_normalized'; or a method registered with "
        "unsloth_adaptive_kl.register_shaping.",
    ),
    FieldSpec(
        "kl_estimator",
        str,
        "k3",
        "Per-token KL estimator, by registered name: k1, k2 (mse, squared), k3 (low_var_kl), abs, k1+, k3+, "
        "bottom_q, or one registered with unsloth_adaptive_kl.register_estimator.",
    ),
    *(FieldSpec(p.name, p.type, p.default, p.help) for p in shaping_parameters(builtin=True)),
    FieldSpec(
        "kl_shaping_kwargs",
        dict | str | None,
        None,
        "The parameters of shaping methods registered with unsloth_adaptive_kl.register_shaping, by name: a dict "
        "(a mapping in YAML, JSON on the command line), e.g. {\"huber_delta\": 0.5}; unset ones take their defaults.",
    ),
    FieldSpec(
        "dynamic_beta_decay",
        float,
        0.9,
        "'dynamic': beta is multiplied by this (in (0, 1]) once per new generation batch's reward (at the end of "
        "the optimizer step that received it) while the trailing mean reward exceeds reward_threshold.",
    ),
    FieldSpec(
        "reward_threshold",
        float,
        0.8,
        "'dynamic': the trailing mean of the raw reward (TRL's logged `reward`) above which beta decays.",
    ),
    FieldSpec(
        "reward_window",
        int,
        10,
        "'dynamic': how many of the most recent generation batches' mean rewards form the trailing mean (>= 1).",
    ),
    FieldSpec(
        "beta_min",
        float,
        0.0,
        "Floor for beta under 'dynamic' and 'target' (0 <= beta_min <= beta). 'dynamic' sets beta to it from "
        "beta_schedule_steps on; at 0 the reference model and KL are no longer computed.",
    ),
    FieldSpec(
        "beta_schedule_steps",
        int,
        1000,
        "'dynamic': from this optimizer step on (global_step >= beta_schedule_steps), beta = beta_min, whatever the "
        "reward (logged once); set it above max_steps for no cut-off (>= 0).",
    ),
    FieldSpec(
        "kl_horizon",
        float,
        10000.0,
        "'target': the horizon of Ziegler et al.'s controller, in completions: "
        "beta *= 1 + clip(kl / kl_target - 1, -0.2, 0.2) * n / kl_horizon (> 0).",
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
        "kl_bottom_q",
        float,
        0.2,
        "'bottom_q' estimator: the fraction [0.01, 1] of valid tokens, lowest reference log-prob first, that get "
        "the KL (scaled by 1 / kl_bottom_q, so at most 100x).",
    ),
    FieldSpec(
        "kl_monitor",
        bool,
        False,
        "With beta = 0 (set, or reached by a β controller), still run the reference forward and compute and log "
        "the KL (adaptive_kl/* and TRL's kl), while the loss stays exactly TRL's beta = 0 loss. Costs the reference "
        "forward. TRL backend and GRPOTrainer(loss_class=...); refused under Unsloth's generated trainer.",
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
        "completions are scored, before the group normalisation of the advantages; the loss then has no KL term). "
        "See docs/kl-placement.md.",
    ),
)

FIELD_NAMES = tuple(f.name for f in FIELDS)
#: The built-in shaping methods' parameters: each is a field; a registered method's are in ``kl_shaping_kwargs``.
SHAPING_FIELDS = tuple(p.name for p in shaping_parameters(builtin=True))
#: The fields a KL term (``kl_term.KLTerm``) reads; the rest configure the β controller.
TERM_FIELD_NAMES = ("kl_adaptation_method", "kl_estimator", *SHAPING_FIELDS, "kl_shaping_kwargs", "kl_bottom_q", "kl_exclude_token_ids")
#: Each field's default, declared once (above): the controllers, the Liger module and the docs read it here.
DEFAULTS = {f.name: f.default for f in FIELDS}


#: The smallest ``kl_bottom_q``: ``bottom_q`` scales the selected tokens' KL by 1 / q, at most 100x.
MIN_BOTTOM_Q = 0.01


def _yaml_hint(value) -> str:
    """The hint for a number that YAML left a string. PyYAML (YAML 1.1) reads exponent form as a float only
    with a dot in the mantissa and a sign in the exponent (``1.0e-3``, ``1.0e+3``): ``1e-3`` and ``1.0e3``
    stay strings. Only such a string gets the hint, with the spelling YAML reads as the same number."""
    if not isinstance(value, str):
        return ""
    mantissa, exponent_mark, exponent = value.strip().lower().partition("e")
    try:
        number = float(value)
    except ValueError:
        return ""
    signed = exponent[:1] in ("+", "-")
    if not exponent_mark or not math.isfinite(number) or ("." in mantissa and signed):
        return ""  # not exponent form, or a spelling YAML reads as a float: this string did not come from YAML
    written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exponent if signed else '+' + exponent}"
    return (
        f" (it is the string {value!r}: YAML reads a number in exponent form as a string unless its mantissa has a "
        f"dot and its exponent a sign; write it as {written})"
    )


def _number(config, name: str, *, integer: bool = False) -> float:
    return _checked_number(name, getattr(config, name), integer=integer)


def _checked_number(name: str, value, *, integer: bool = False) -> float:
    ok_types = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types) or (not integer and not math.isfinite(value)):
        kind = "an integer" if integer else "a finite number"
        raise ValueError(f"{name}={value!r} is not valid; allowed: {kind}{_yaml_hint(value)}")
    return value


def checked_beta(value, name: str = "beta", *, source: str = ""):
    """``value`` if it is a valid β: a finite number >= 0 (an int or a float, not a bool). Otherwise
    ValueError naming ``name``, the value and what is allowed; ``source`` starts the message (where
    the value was read, e.g. a checkpoint's controller state). The one check of a β, wherever it enters."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{source}{name}={value!r} is not valid; allowed: a finite number >= 0{_yaml_hint(value)}")
    return value


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


def _check_parameter(parameter: Parameter, label: str, value):
    if parameter.type in (int, float):
        value = _checked_number(label, value, integer=parameter.type is int)
    elif not isinstance(value, parameter.type):
        raise ValueError(f"{label}={value!r} is not valid; allowed: a {parameter.type.__name__}")
    _require(parameter.check is None or parameter.check(value), label, value, parameter.allowed)
    return value


def excluded_token_ids(value, name: str = "kl_exclude_token_ids") -> tuple[int, ...]:
    """``kl_exclude_token_ids`` as a sorted tuple without repeats (None: empty); ValueError naming the field,
    the value and what is allowed for anything but a list (or tuple) of non-negative ints."""
    if value is None:
        return ()
    valid = isinstance(value, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    _require(valid, name, value, "a list of non-negative integer token ids, e.g. [tokenizer.eos_token_id], or None")
    return tuple(sorted(set(value)))


def shaping_kwargs(config) -> dict:
    """``config.kl_shaping_kwargs`` as a dict (None: empty; a string: its JSON), its keys checked."""
    value = getattr(config, "kl_shaping_kwargs", None)
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"kl_shaping_kwargs={value!r} is not valid; allowed: a dict, or its JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"kl_shaping_kwargs={value!r} is not valid; allowed: a dict of parameters of registered shaping methods")
    registered = [p.name for p in shaping_parameters() if p.name not in SHAPING_FIELDS]
    unknown = [key for key in value if key not in registered]
    if unknown:
        fields = [key for key in unknown if key in SHAPING_FIELDS]
        hint = f" ({fields}: set as fields of GRPOConfig)" if fields else ""
        raise ValueError(f"kl_shaping_kwargs has unknown key(s) {unknown}{hint}; allowed: the parameters of registered shaping methods {registered}")
    return value


def shaping_values(config, method: Method) -> dict[str, object]:
    """The value of every parameter of ``method``'s shaping steps (checked), and of every built-in
    one (they are fields, checked whatever the method): name -> value."""
    given = shaping_kwargs(config)
    values = {}
    for parameter in shaping_parameters():
        if parameter.name in SHAPING_FIELDS:
            values[parameter.name] = _check_parameter(parameter, parameter.name, getattr(config, parameter.name))
        elif parameter.name in given or parameter in method.parameters:
            value = given.get(parameter.name, parameter.default)
            values[parameter.name] = _check_parameter(parameter, f"kl_shaping_kwargs[{parameter.name!r}]", value)
    return {p.name: values[p.name] for p in method.parameters}


def validate(config) -> Method:
    """Check the adaptive-KL fields of ``config`` (any object with them as attributes).

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
    excluded_token_ids(config.kl_exclude_token_ids)
    beta = checked_beta(config.beta)
    shaping_values(config, method)
    horizon = _number(config, "kl_horizon")
    _require(horizon > 0, "kl_horizon", horizon, "a number > 0")
    decay = _number(config, "dynamic_beta_decay")
    _require(0 < decay <= 1, "dynamic_beta_decay", decay, "a number in (0, 1]")
    _number(config, "reward_threshold")
    window = _number(config, "reward_window", integer=True)
    _require(window >= 1, "reward_window", window, "an integer >= 1")
    steps = _number(config, "beta_schedule_steps", integer=True)
    _require(steps >= 0, "beta_schedule_steps", steps, "an integer >= 0")
    q = _number(config, "kl_bottom_q")
    _require(MIN_BOTTOM_Q <= q <= 1, "kl_bottom_q", q, f"a number in [{MIN_BOTTOM_Q}, 1] (bottom_q scales the KL by 1 / q)")
    fused_head_setting(config.liger_fused_head)
    beta_min = _number(config, "beta_min")
    _require(0 <= beta_min <= beta, "beta_min", beta_min, f"a number in [0, beta={beta}]")
    if method.is_none and beta == 0 and not config.kl_monitor and get_estimator(config.kl_estimator).name != DEFAULTS["kl_estimator"]:
        raise ValueError(
            f"kl_estimator={config.kl_estimator!r} is not valid with beta=0.0: beta=0 removes the KL term (and TRL's "
            f"default beta is 0.0), so the estimator would never act; allowed: beta > 0, kl_monitor=True (the KL is "
            f"logged), or kl_estimator={DEFAULTS['kl_estimator']!r}"
        )
    if not method.is_none and beta == 0:
        raise ValueError(
            f"beta=0.0 is not valid with kl_adaptation_method={config.kl_adaptation_method!r}: that method acts on "
            "the KL term, which beta=0 removes; allowed: beta > 0, or kl_adaptation_method='none'"
        )
    check_placement(config.kl_placement, method, beta)
    if config.kl_monitor and config.kl_placement != "loss":
        raise ValueError(
            f"kl_monitor=True is not valid with kl_placement={config.kl_placement!r}: it watches the KL at beta = 0 of the "
            "loss placement; allowed: kl_monitor=False, or kl_placement='loss'"
        )
    return method


#: ``kl_placement``'s values: where β·KL acts (docs/kl-placement.md).
PLACEMENTS = ("loss", "reward")


def check_placement(placement, method: Method, beta) -> str:
    """``placement`` if it is a valid ``kl_placement`` for ``method`` and ``beta``; ValueError otherwise.

    In the reward every per-token shaping step applies (it shapes the KL summed into the penalty), and
    ``length_normalized`` makes the penalty a per-completion mean instead of a sum; a shaping step that
    acts on the loss's aggregation in another way has no meaning there and is refused by name."""
    _require(placement in PLACEMENTS, "kl_placement", placement, f"one of {list(PLACEMENTS)}")
    if placement == "reward":
        if beta == 0:
            raise ValueError(
                "kl_placement='reward' is not valid with beta=0.0: the reward is lowered by beta times the KL, which "
                "beta=0 removes (and TRL then computes no reference log-probs); allowed: beta > 0, or kl_placement='loss'"
            )
        for name in method.shaping:
            if not SHAPING[name].per_token and name != "length_normalized":
                raise ValueError(
                    f"kl_placement='reward' is not valid with the shaping method {name!r}: it acts on the loss's "
                    "aggregation of the KL, which the reward placement does not have (the penalty is a sum over each "
                    "completion's tokens); allowed: per-token shaping methods and length_normalized, or kl_placement='loss'"
                )
    return placement

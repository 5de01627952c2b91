"""The GRPOConfig fields: presence, defaults, serialisation, CLI/YAML, import order, validation."""

import ast
import re
import pathlib
import pytest
import torch

import unsloth_adaptive_kl  # noqa: F401  (patches TRL)
from trl import GRPOConfig
from transformers import HfArgumentParser

from unsloth_adaptive_kl.config import DEFAULTS
from unsloth_adaptive_kl.estimators import builtin_estimator_names
from unsloth_adaptive_kl.method import parse_method

from fresh_process_cases import FAILED, run_cases

CPU = dict(output_dir="/tmp/uakl-config-test", use_cpu=True, bf16=False, report_to="none")

SEED_DEFAULTS = {
    "kl_adaptation_method": "none",
    "kl_clip_threshold": 1.0,
    "kl_target": 0.1,
    "dynamic_beta_decay": 0.9,
    "reward_threshold": 0.8,
    "beta_min": 0.0,
    "beta_schedule_steps": 1000,
}


def test_fields_have_the_seed_defaults_and_appear_in_to_dict():
    config = GRPOConfig(**CPU)
    d = config.to_dict()
    for name, default in SEED_DEFAULTS.items():
        assert getattr(config, name) == default
        assert d[name] == default
    assert d["kl_estimator"] == "k3" and d["kl_horizon"] == 10000.0 and d["reward_window"] == 10


def test_fields_parse_from_cli_flags_and_yaml(tmp_path):
    parser = HfArgumentParser(GRPOConfig)
    (cli,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "False", "--beta", "0.1", "--kl_adaptation_method", "ziegler+clip", "--kl_horizon", "500", "--reward_window", "3"]
    )
    assert (cli.kl_adaptation_method, cli.kl_horizon, cli.reward_window) == ("ziegler+clip", 500.0, 3)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nbeta: 0.2\nkl_adaptation_method: dynamic\nreward_threshold: 0.5\nbeta_schedule_steps: 7\n")
    (from_yaml,) = parser.parse_yaml_file(str(yaml_file))
    assert (from_yaml.kl_adaptation_method, from_yaml.reward_threshold, from_yaml.beta_schedule_steps) == ("dynamic", 0.5, 7)


@pytest.mark.parametrize("given, setting", [(None, "auto"), ("auto", "auto"), ("false", False), ("True", True)])
def test_liger_fused_head_from_the_command_line(tmp_path, given, setting):
    from unsloth_adaptive_kl.config import fused_head_setting

    flags = [] if given is None else ["--liger_fused_head", given]
    (cli,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "False", *flags])
    assert fused_head_setting(cli.liger_fused_head) == setting


def test_a_registered_methods_parameters_are_set_from_the_config_yaml_and_flags_and_checked(tmp_path):
    from trl import TrlParser

    from unsloth_adaptive_kl import Parameter, register_shaping, unregister_shaping
    from unsloth_adaptive_kl.config import build

    @register_shaping("scaled", parameters=(Parameter("scaled_by", float, 0.5, check=lambda v: 0 < v <= 1, allowed="a number in (0, 1]", keyword="by"),))
    def scaled(kl, by):
        return by * kl

    try:
        base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.1, kl_adaptation_method="scaled")
        assert build(GRPOConfig(**base)).term.shaping_parameters == (("scaled_by", 0.5),)  # its default
        assert build(GRPOConfig(**base, kl_shaping_kwargs={"scaled_by": 0.25})).term.shaping_parameters == (("scaled_by", 0.25),)
        yaml_file = tmp_path / "c.yaml"
        yaml_file.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nbeta: 0.1\nkl_adaptation_method: clip+scaled\nkl_shaping_kwargs:\n  scaled_by: 0.75\n")
        (from_yaml,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(yaml_file)])
        assert build(from_yaml).term.shaping_parameters == (("kl_clip_threshold", 1.0), ("scaled_by", 0.75))
        (from_flag,) = TrlParser((GRPOConfig,)).parse_args_and_config(["--config", str(yaml_file), "--kl_shaping_kwargs", '{"scaled_by": 1.0}'])
        assert build(from_flag).term.shaping_parameters[-1] == ("scaled_by", 1.0)
        for bad, message in (({"scaled_by": 2.0}, r"kl_shaping_kwargs\['scaled_by'\]=2.0 is not valid; allowed: a number in \(0, 1\]"),
                             ({"scaled_by": "x"}, r"kl_shaping_kwargs\['scaled_by'\]='x' is not valid; allowed: a number in \(0, 1\]"),
                             ({"scaledby": 1.0}, r"kl_shaping_kwargs has unknown key\(s\) \['scaledby'\]; allowed: .*'scaled_by'"),
                             ("{not json", r"kl_shaping_kwargs='\{not json' is not valid; allowed: a dict, or its JSON")):
            with pytest.raises(ValueError, match=message):
                GRPOConfig(**base, kl_shaping_kwargs=bad)
    finally:
        unregister_shaping("scaled")
    with pytest.raises(ValueError, match="unknown part"):  # gone with its registration
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, beta=0.1, kl_adaptation_method="scaled")


# Two cases that need a process where trl is imported before the package (the import patches TRL process-wide), run in
# one process (tests/fresh_process_cases.py): `from trl import GRPOConfig` and a config made, then `import unsloth_adaptive_kl`.
BEFORE_THE_IMPORT = {
    "import_order": """
        c = GRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, beta=0.1, kl_adaptation_method="clip", kl_clip_threshold=0.5)
        assert c.kl_clip_threshold == 0.5 and c.to_dict()["kl_adaptation_method"] == "clip"
        try:
            GRPOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False, kl_adaptation_method="nope")
        except ValueError as e:
            assert "kl_adaptation_method" in str(e)
        else:
            raise SystemExit("not validated")
        print("ok")
    """,
    "config_made_before": """
        from trl import GRPOTrainer
        import toy
        from unsloth_adaptive_kl.config import DEFAULTS
        # read before any trainer: to_dict() walks every field of the (patched) class; it raised AttributeError
        assert args_made_before.to_dict()["kl_target"] == DEFAULTS["kl_target"] and args_made_before.kl_adaptation_method == "none"
        trainer = GRPOTrainer(model=CHECKPOINT, reward_funcs=[toy.format_reward], args=args_made_before,
                              train_dataset=toy.prompt_dataset(8))
        assert args_made_before.kl_adaptation_method == "none" and args_made_before.to_dict()["kl_estimator"] == "k3"
        trainer.train()
        assert trainer.state.log_history[0]["adaptive_kl/current_beta"] == 0.04
        print("ok")
    """,
}


@pytest.fixture(scope="module")
def before_the_import(tiny_checkpoint, tmp_path_factory):
    preamble = f"""
        from trl import GRPOConfig          # imported before the patch
        CHECKPOINT = {tiny_checkpoint!r}
        args_made_before = GRPOConfig(output_dir={str(tmp_path_factory.mktemp("before"))!r}, use_cpu=True, bf16=False,
                                      report_to="none", beta=0.04, per_device_train_batch_size=4, num_generations=4,
                                      max_completion_length=4, max_steps=1, save_strategy="no")
        import unsloth_adaptive_kl
    """
    return run_cases(preamble, BEFORE_THE_IMPORT)


def test_import_order_does_not_matter(before_the_import):
    stdout, stderr = before_the_import
    out = stdout["import_order"]
    assert FAILED not in out and out.strip().endswith("ok"), out[-2000:] + stderr["import_order"][-2000:]


BAD = [
    (dict(kl_adaptation_method="adaptive"), "kl_adaptation_method", "adaptive"),
    (dict(kl_adaptation_method="dynamic+target"), "kl_adaptation_method", "dynamic+target"),
    (dict(kl_estimator="k7"), "kl_estimator", "k7"),
    (dict(kl_clip_threshold=0.0), "kl_clip_threshold", "0.0"),
    (dict(kl_clip_threshold=-1.0), "kl_clip_threshold", "-1.0"),
    (dict(kl_target=0.0), "kl_target", "0.0"),
    (dict(kl_horizon=-5.0), "kl_horizon", "-5.0"),
    (dict(dynamic_beta_decay=0.0), "dynamic_beta_decay", "0.0"),
    (dict(dynamic_beta_decay=1.01), "dynamic_beta_decay", "1.01"),
    (dict(beta_min=0.5), "beta_min", "0.5"),
    (dict(beta_min=-0.1), "beta_min", "-0.1"),
    (dict(beta_schedule_steps=-1), "beta_schedule_steps", "-1"),
    (dict(reward_window=0), "reward_window", "0"),
    (dict(kl_bottom_q=0.0), "kl_bottom_q", "0.0"),
    (dict(kl_bottom_q=1.5), "kl_bottom_q", "1.5"),
    (dict(kl_bottom_q=0.001), "kl_bottom_q", "0.001"),  # 1/q = 1000 would blow the KL up; the floor is 0.01
    (dict(reward_threshold=float("nan")), "reward_threshold", "nan"),
    (dict(beta=-0.1), "beta", "-0.1"),
    (dict(beta=float("nan")), "beta", "nan"),
    (dict(beta=float("inf")), "beta", "inf"),
    (dict(beta=0.0, kl_adaptation_method="dynamic"), "beta", "0.0"),
    (dict(beta=0.0, kl_adaptation_method="clip"), "beta", "0.0"),
    (dict(liger_fused_head="yes"), "liger_fused_head", "yes"),
    (dict(liger_fused_head=1), "liger_fused_head", "1"),
    # soft_clip computes c * tanh(kl / c) in the KL's dtype: in float32 1e39 is inf and 1e-300 is 0, a NaN on every token
    (dict(kl_adaptation_method="soft_clip", kl_clip_threshold=1e39), "kl_clip_threshold", "1e+39"),
    (dict(kl_adaptation_method="soft_clip", kl_clip_threshold=1e-300), "kl_clip_threshold", "1e-300"),
    (dict(kl_estimator=["k3"]), "kl_estimator", "['k3']"),  # was a TypeError from the registry's dict lookup
    (dict(kl_estimator={"k3": 1}), "kl_estimator", "{'k3': 1}"),
    (dict(beta=0.0, kl_exclude_token_ids=[1]), "kl_exclude_token_ids", "[1]"),  # no KL term: the ids would leave out nothing
]


@pytest.mark.parametrize("overrides, field, value", BAD, ids=[f"{f}={v}" for _, f, v in BAD])
def test_bad_config_raises_value_error_naming_field_value_and_allowed(overrides, field, value):
    with pytest.raises(ValueError) as info:
        GRPOConfig(**CPU, **{"beta": 0.1, **overrides})
    message = str(info.value)
    assert field in message and value in message and "allowed" in message


def test_beta_zero_with_method_none_is_plain_trl():
    assert GRPOConfig(**CPU, beta=0.0).kl_adaptation_method == "none"


def test_core_modules_import_only_torch():
    package = pathlib.Path(unsloth_adaptive_kl.__file__).parent
    core = ["registry.py", "estimator_registry.py", "estimators.py", "shaping.py", "kl_term.py", "controller_base.py", "controllers.py"]
    core += [path.name for path in package.glob("*_controller.py")] + ["method.py", "config.py", "metrics.py", "adaptation.py", "declarations.py"]
    for name in core:
        tree = ast.parse((package / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
        # difflib: the standard library's, for a misspelt method's "did you mean"; numbers: to name a numpy scalar's type
        allowed = {"torch", "math", "numbers", "json", "dataclasses", "collections", "typing", "logging", "difflib", "__future__"}
        assert imported <= allowed, (name, imported)


def test_a_yaml_exponent_without_a_dot_is_refused_with_yaml_float_syntax_hint(tmp_path):
    parser = HfArgumentParser(GRPOConfig)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nbeta: 0.1\nbeta_min: 1e-3\n")
    with pytest.raises(ValueError) as info:
        parser.parse_yaml_file(str(yaml_file))
    message = str(info.value)
    assert "beta_min='1e-3'" in message and "YAML" in message and "1.0e-3" in message
    yaml_file.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nbeta: 0.1\nbeta_min: 1.0e-3\n")
    (config,) = parser.parse_yaml_file(str(yaml_file))
    assert config.beta_min == 0.001
    with pytest.raises(ValueError) as info:  # a string that is no number gets no YAML hint
        GRPOConfig(**CPU, beta=0.1, beta_min="small")
    assert "YAML" not in str(info.value)


def test_a_config_made_before_the_import_trains_with_the_defaults(before_the_import):
    stdout, stderr = before_the_import
    out, err = stdout["config_made_before"], stderr["config_made_before"]
    assert FAILED not in out and out.strip().endswith("ok"), out[-2000:] + err[-3000:]
    assert "created before `import unsloth_adaptive_kl`" in err and "create the config after the import" in err


def test_a_config_made_before_the_import_then_given_fields_says_which_method_it_trains(caplog):
    """A config made before the import lacks the fields; a user who then sets some on the object trains with them. The
    line at trainer creation says which were set and the method that trains (it said "defaults (kl_adaptation_method=
    'none')" while the run trained `dynamic`). The object is made as the old class would: without the fields."""
    from unsloth_adaptive_kl.backends._config_class import fill_missing_fields
    from unsloth_adaptive_kl.config import FIELDS

    def made_before():
        config = GRPOConfig(**CPU, beta=0.04)
        for f in FIELDS:
            del config.__dict__[f.name]
        assert "kl_adaptation_method" not in vars(config)  # (the patched class reads as the defaults)
        return config

    plain, edited = made_before(), made_before()
    edited.kl_adaptation_method, edited.reward_threshold = "dynamic", 0.1
    with caplog.at_level("INFO", logger="unsloth_adaptive_kl"):
        fill_missing_fields(plain)
        fill_missing_fields(edited)
    first, second = [r.getMessage() for r in caplog.records if "created before" in r.getMessage()]
    assert "its adaptive-KL fields take their defaults. It trains with kl_adaptation_method='none'." in first
    assert ("the adaptive-KL fields not set on it since take their defaults (set: kl_adaptation_method, reward_threshold). "
            "It trains with kl_adaptation_method='dynamic'.") in second
    assert (edited.kl_adaptation_method, edited.reward_threshold, edited.beta_min) == ("dynamic", 0.1, DEFAULTS["beta_min"])
    assert plain.kl_adaptation_method == "none"


@pytest.mark.parametrize("estimator", [name for name in builtin_estimator_names() if name != DEFAULTS["kl_estimator"]])
def test_a_kl_estimator_with_trls_default_beta_zero_is_refused(estimator):
    # TRL's default beta is 0.0: before the fix GRPOConfig(kl_estimator=...) alone was accepted and did nothing.
    with pytest.raises(ValueError, match=rf"kl_estimator='{re.escape(estimator)}' is not valid with beta=0.0.*allowed: beta > 0"):
        GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, kl_estimator=estimator)
    assert GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, kl_estimator=estimator, beta=0.01).kl_estimator == estimator
    assert GRPOConfig(output_dir="unused", use_cpu=True, bf16=False).beta == 0.0  # TRL's default, with the default estimator, stays valid


def test_none_joined_with_another_method_is_refused_clearly():
    with pytest.raises(ValueError, match=r"kl_adaptation_method='none\+clip' joins 'none' \(no adaptation\) with other parts; allowed: 'none' alone"):
        parse_method("none+clip")


@pytest.mark.parametrize("value, closest", [("dapoo", "dapo"), ("DAPO", "dapo"), ("grpo ", "grpo"), ("dr-grpo", "dr_grpo"), ("ppo", None), (None, None)])
def test_a_loss_type_no_trl_has_is_refused_naming_the_field_the_value_and_the_allowed_values(value, closest):
    # issue 39, item 5: before, the config was accepted and the trainer blamed the TRL version ("a newer TRL has it").
    with pytest.raises(ValueError) as info:
        GRPOConfig(**CPU, beta=0.1, loss_type=value)
    message = str(info.value)
    assert f"loss_type={value!r} is not valid: no TRL release has this loss type" in message
    assert "allowed with the installed trl" in message and "grpo, bnpo, dr_grpo, dapo" in message
    assert "newer TRL" not in message
    assert (f"did you mean {closest!r}?" in message) if closest else ("did you mean" not in message)


def test_every_loss_type_some_trl_has_is_accepted_by_the_config():
    from unsloth_adaptive_kl import versions

    for loss_type in versions.ALL_LOSS_TYPES:  # the installed TRL's trainer refuses one it lacks, naming the TRL that has it
        assert GRPOConfig(**CPU, beta=0.1, loss_type=loss_type).loss_type == loss_type


@pytest.mark.parametrize("text", ["1e-3", "5E-2", "1.0e3", "1e3", "-2e-1", "+3e-4"])
def test_the_yaml_hint_names_a_spelling_yaml_reads_as_the_same_float(text):
    import yaml

    loaded = yaml.safe_load(f"beta_min: {text}")["beta_min"]
    assert loaded == text  # YAML 1.1 left it a string
    with pytest.raises(ValueError) as info:
        GRPOConfig(**CPU, beta=1.0, beta_min=loaded)
    message = str(info.value)
    written = message.rpartition("write it as ")[2].rstrip(")")
    assert yaml.safe_load(f"beta_min: {written}")["beta_min"] == float(text)  # a float, the same number


@pytest.mark.parametrize("text", ["0.5", "1.0e-3", "1.0e+3", ".5e-3", "nan", "inf", "1e400", "small"])
def test_a_string_yaml_would_not_have_left_a_string_gets_no_yaml_hint(text):
    # issue 39, item 7: before, any string float() reads ('0.5' included) got "write it with a dot, e.g. 0.5".
    with pytest.raises(ValueError) as info:
        GRPOConfig(**CPU, beta=1.0, beta_min=text)
    assert f"beta_min={text!r} is not valid" in str(info.value) and "YAML" not in str(info.value)


# not a registry list: cases chosen for what they show (a setting read by another method, by the estimator, by none)
UNREAD_CASES = [
    ("clip", {"reward_threshold": 0.5, "beta_min": 0.01},
     ["reward_threshold=0.5 has no effect: kl_adaptation_method='clip' with kl_estimator='k3' does not read it (read by 'dynamic')",
      "beta_min=0.01 has no effect: kl_adaptation_method='clip' with kl_estimator='k3' does not read it "
      "(read by 'dynamic', 'reward_conditioned', 'schedule', 'target', 'ziegler')"]),
    ("none", {"kl_clip_threshold": 2.0}, ["kl_clip_threshold=2.0 has no effect: kl_adaptation_method='none' with "
                                          "kl_estimator='k3' does not read it (read by 'clip', 'soft_clip')"]),
    ("target", {"kl_target": 0.2, "kl_horizon": 5.0}, ["kl_horizon=5.0 has no effect: kl_adaptation_method='target' with "
                                                       "kl_estimator='k3' does not read it (read by 'ziegler')"]),
    ("dynamic+clip", {"reward_threshold": 0.5, "kl_clip_threshold": 2.0, "beta_min": 0.01}, []),  # not a registry list: one chosen case
    ("ziegler", {"kl_target": 0.2, "kl_horizon": 5.0}, []),
    # kl_monitor acts at beta = 0 only: under a fixed beta > 0 (no controller) it never does; under a controller it may
    ("clip", {"kl_monitor": True, "kl_monitor_every": 4},
     [f"{field} has no effect: it logs the KL at steps where beta = 0, and beta=0.04 is fixed (kl_adaptation_method='clip' "
      "has no β controller), unless it is set to 0 by hand (trainer.beta = 0)" for field in ("kl_monitor=True", "kl_monitor_every=4")]),
    ("dynamic", {"kl_monitor": True, "beta_min": 0.0}, []),
]


@pytest.mark.parametrize("method, settings, expected", UNREAD_CASES)
def test_a_setting_the_chosen_method_does_not_read_is_warned_naming_what_reads_it(method, settings, expected, caplog):
    """A field set to other than its default that nothing of the run reads (not the method's shaping, not its β
    controller, not the estimator) has no effect: one warning each when the KL state is made (every backend makes it
    so), naming the methods that read it. A field the method reads, or a default, says nothing."""
    from unsloth_adaptive_kl.adaptation import AdaptiveKL

    config = GRPOConfig(**CPU, beta=0.04, kl_adaptation_method=method, **settings)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        AdaptiveKL(config)
    said = [r.getMessage().removeprefix("unsloth_adaptive_kl: ") for r in caplog.records if "has no effect" in r.getMessage()]
    assert sorted(said) == sorted(expected)


def test_an_estimator_parameter_is_unread_under_another_estimator(caplog):
    from unsloth_adaptive_kl.adaptation import AdaptiveKL
    from unsloth_adaptive_kl.config import unread_settings

    plain = GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="clip")
    assert unread_settings(plain, parse_method("clip")) == []  # every field at its default
    readers = {}
    for name in builtin_estimator_names():
        from unsloth_adaptive_kl.estimators import get_estimator
        for p in get_estimator(name).parameters:
            readers.setdefault(p.name, (name, p))
    if not readers:
        pytest.skip("no built-in estimator declares a parameter")
    field, (estimator, parameter) = next(iter(readers.items()))
    other = next(n for n in builtin_estimator_names() if field not in {p.name for p in get_estimator(n).parameters})
    value = parameter.default * 2 if isinstance(parameter.default, (int, float)) and parameter.default else 0.5
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        AdaptiveKL(GRPOConfig(**CPU, beta=0.04, kl_estimator=other, **{field: value}))
        AdaptiveKL(GRPOConfig(**CPU, beta=0.04, kl_estimator=estimator, **{field: value}))
    said = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(said) == 1 and f"{field}={value!r} has no effect" in said[0] and f"kl_estimator={estimator!r}" in said[0]


def test_a_registered_parameter_set_in_kl_shaping_kwargs_that_the_method_does_not_read_is_warned(caplog):
    """A key of kl_shaping_kwargs (a registered step's parameter) with a method that does not use that step has no
    effect, as a field would: one warning naming what reads it (before, nothing was said)."""
    from unsloth_adaptive_kl import register_shaping, unregister_shaping
    from unsloth_adaptive_kl.adaptation import AdaptiveKL
    from unsloth_adaptive_kl.declarations import Parameter

    register_shaping("damped_for_test", parameters=(Parameter("damping_for_test", default=1.0, allowed="a number"),))(
        lambda kl, damping_for_test: kl * damping_for_test)
    try:
        with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
            AdaptiveKL(GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="clip", kl_shaping_kwargs={"damping_for_test": 0.5}))
            AdaptiveKL(GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="clip+damped_for_test", kl_shaping_kwargs={"damping_for_test": 0.5}))
    finally:
        unregister_shaping("damped_for_test")
    said = [r.getMessage().removeprefix("unsloth_adaptive_kl: ") for r in caplog.records if "has no effect" in r.getMessage()]
    assert said == ["kl_shaping_kwargs['damping_for_test']=0.5 has no effect: kl_adaptation_method='clip' with "
                    "kl_estimator='k3' does not read it (read by 'damped_for_test')"]


def test_a_number_of_the_wrong_type_is_refused_with_what_the_field_allows():
    """Before, a wrong type said only "a finite number" or "an integer", not the field's range; a numpy scalar got
    "allowed: an integer" for np.int64(5) (it is no Python int: a config keeps it, and it is no JSON)."""
    import numpy as np

    for overrides, expected in [
        (dict(reward_window=2.0), "reward_window=2.0 is not valid; allowed: an integer >= 1"),
        (dict(kl_target=float("nan")), "kl_target=nan is not valid; allowed: a number > 0"),
        (dict(reward_window=np.int64(5)), "reward_window=np.int64(5) is not valid; allowed: an integer >= 1 (it is a "
                                          "numpy.int64: pass a Python number, int(value) or float(value))"),
        (dict(beta=np.float32(0.5)), "beta=np.float32(0.5) is not valid; allowed: a finite number >= 0 (it is a "
                                     "numpy.float32: pass a Python number, int(value) or float(value))"),
    ]:
        with pytest.raises(ValueError) as info:
            GRPOConfig(**CPU, **{"beta": 0.04, "kl_adaptation_method": "dynamic", **overrides})
        assert str(info.value) == expected


def test_soft_clip_is_finite_at_both_ends_of_the_allowed_threshold():
    """The allowed range of kl_clip_threshold is where c * tanh(kl / c) stays finite in float32, with its gradient."""
    from unsloth_adaptive_kl.declarations import FLOAT32_POSITIVE
    from unsloth_adaptive_kl.shaping import soft_clip

    for threshold in FLOAT32_POSITIVE:
        GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="soft_clip", kl_clip_threshold=threshold)
        kl = torch.tensor([0.0, 1e-3, 50.0], requires_grad=True)
        out = soft_clip(kl, threshold)
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(kl.grad).all(), (threshold, out, kl.grad)
    with pytest.raises(ValueError, match="kl_clip_threshold"):
        GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="soft_clip", kl_clip_threshold=FLOAT32_POSITIVE[1] * 1.01)
    assert torch.isnan(soft_clip(torch.tensor([0.0]), float("inf"))).all()  # what the refused values would do
    assert torch.isnan(soft_clip(torch.tensor([0.0]), 0.0)).all()


def test_an_unread_setting_is_warned_by_the_main_process_only(caplog):
    from unsloth_adaptive_kl.adaptation import AdaptiveKL

    config = GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="clip", reward_threshold=0.5)
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        AdaptiveKL(config, process_index=1, num_processes=2)
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()]
    with caplog.at_level("WARNING", logger="unsloth_adaptive_kl"):
        AdaptiveKL(config, process_index=0, num_processes=2)
    assert len([r for r in caplog.records if "has no effect" in r.getMessage()]) == 1


# not a registry list: misspellings chosen for what they show (a typo, a case, a missing underscore, one of two parts)
@pytest.mark.parametrize("given, unknown, meant", [("dynamc", "dynamc", "dynamic"), ("Target", "Target", "target"),
                                                   ("softclip", "softclip", "soft_clip"), ("dynamic+clp", "clp", "clip")])
def test_a_misspelt_method_is_refused_with_the_closest_name(given, unknown, meant):
    with pytest.raises(ValueError) as caught:
        GRPOConfig(**CPU, beta=0.04, kl_adaptation_method=given)
    assert f"kl_adaptation_method={given!r} has unknown part(s) [{unknown!r}] (did you mean {meant!r}?); allowed: one of [" in str(caught.value)


def test_a_method_name_far_from_every_name_gets_no_guess():
    with pytest.raises(ValueError) as caught:
        GRPOConfig(**CPU, beta=0.04, kl_adaptation_method="banana")
    assert "has unknown part(s) ['banana']; allowed:" in str(caught.value) and "did you mean" not in str(caught.value)

"""TRL's GRPO command line with the adaptive-KL fields: examples/grpo_recipe.yaml run for a few
steps on the CPU through ``python -m unsloth_adaptive_kl grpo`` (TRL's CLI entry, which starts the
training module through ``accelerate launch``) and through ``accelerate launch -m
unsloth_adaptive_kl.trl_grpo``; bad field values stop it with an error naming the field.

Subprocesses are what cost here (each imports torch, transformers and TRL, ~9 s of CPU), so the cases that check
parsing and validation call, in this process, the function an entry point runs with the same arguments
(``__main__.main`` for ``python -m unsloth_adaptive_kl`` and the ``unsloth-adaptive-kl`` script, ``trl_grpo.train``
for the processes ``accelerate launch`` starts), and each entry point also runs for real: ``python -m`` trains (one
and two processes) and refuses to start on a failed patch, the console script refuses a misspelt YAML key and bad
field values in one line on stderr with exit status 2 (printing nothing to stdout, starting nothing: a few seconds
each), ``accelerate launch`` trains and refuses a misspelt YAML key."""

import json
import os
import runpy
import subprocess
import sys

import pytest

from unsloth_adaptive_kl.__main__ import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "examples", "grpo_recipe.yaml")
PREPARE = os.path.join(ROOT, "examples", "prepare_toy.py")
BIN = os.path.dirname(sys.executable)  # the console scripts installed beside this Python: accelerate, unsloth-adaptive-kl
BETA = 0.04  # the recipe's beta


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    """The recipe's model and data set, built by examples/prepare_toy.py (small, no warm start)."""
    directory = tmp_path_factory.mktemp("toy")
    argv = sys.argv
    sys.argv = [PREPARE, str(directory), "--warm-start-steps", "0", "--prompts", "64"]
    try:
        runpy.run_path(PREPARE, run_name="__main__")
    finally:
        sys.argv = argv
    assert os.path.isfile(directory / "data" / "train.jsonl") and os.path.isfile(directory / "model" / "config.json")
    return directory


def _env():
    env = {**os.environ, "TRITON_INTERPRET": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # The child processes import this checkout's package, whether or not it is installed.
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _paths(toy_dir, output_dir):
    return ["--model_name_or_path", str(toy_dir / "model"), "--dataset_name", str(toy_dir / "data"), "--output_dir", str(output_dir)]


def _log_history(output_dir, step):
    with open(os.path.join(output_dir, f"checkpoint-{step}", "trainer_state.json")) as f:
        return json.load(f)["log_history"]


def _assert_dynamic_beta_halves(history, steps):
    """The recipe's method is dynamic+length_normalized; the flags set decay 0.5 and a reward
    threshold every reward is above, so beta halves after every optimizer step from the YAML's 0.04."""
    logged = [h for h in history if "adaptive_kl/current_beta" in h]
    assert [h["step"] for h in logged] == list(range(1, steps + 1))
    for h in logged:
        assert h["adaptive_kl/current_beta"] == pytest.approx(BETA * 0.5 ** (h["step"] - 1), rel=1e-6)
        assert h["adaptive_kl/raw_kl"] is not None and h["adaptive_kl/adapted_kl"] is not None


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_recipe_runs_through_the_cli_with_yaml_fields_and_flag_overrides(toy_dir, tmp_path, processes):
    out = tmp_path / "out"
    flags = ["--max_steps", "3", "--dynamic_beta_decay", "0.5", "--reward_threshold", "-1", "--save_strategy", "steps", "--save_steps", "3"]
    if processes > 1:  # accelerate's flags, passed through as with `trl grpo`: torchrun and gloo on CPU
        flags += ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no", "--use_cpu", "true"]
    proc = subprocess.run(
        [sys.executable, "-m", "unsloth_adaptive_kl", "grpo", "--config", RECIPE, *_paths(toy_dir, out), *flags],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = _log_history(out, 3)
    _assert_dynamic_beta_halves(history, 3)
    # Each process takes one prompt (8 completions, 8 generations) per step from the 64 prompts:
    # the epoch counter tells how many processes trained.
    assert history[-1]["epoch"] == pytest.approx(3 * processes / 64, rel=1e-3)
    assert os.path.isfile(out / "model.safetensors")  # TRL's script saved the model at the end


@pytest.fixture(scope="module")
def accelerate_reward_run(toy_dir, tmp_path_factory):
    """``accelerate launch -m unsloth_adaptive_kl.trl_grpo`` on the recipe with ``kl_placement: reward`` set in its
    YAML, 2 steps: one run read by the accelerate-launch test and the reward-placement test (it was two runs, the
    accelerate one with the KL in the loss; ``python -m`` trains that placement above, with one and two processes)."""
    from trl import GRPOTrainer

    from unsloth_adaptive_kl.backends.reward_placement import unavailable_reason

    reason = unavailable_reason(GRPOTrainer)
    if reason is not None:  # the package refuses the placement on this TRL (docs/kl-placement.md), by its own check
        pytest.skip(f"kl_placement='reward' is not available here: {reason}")
    tmp_path = tmp_path_factory.mktemp("accelerate_reward")
    with open(RECIPE) as f:
        recipe = f.read()
    assert "\nkl_placement: loss " in recipe
    config = tmp_path / "reward.yaml"
    config.write_text(recipe.replace("\nkl_placement: loss ", "\nkl_placement: reward "))
    out = tmp_path / "out"
    flags = ["--max_steps", "2", "--dynamic_beta_decay", "0.5", "--reward_threshold", "-1", "--save_strategy", "steps", "--save_steps", "2"]
    proc = subprocess.run(
        [os.path.join(BIN, "accelerate"), "launch", "--num_processes", "1", "-m", "unsloth_adaptive_kl.trl_grpo", "--config", str(config),
         *_paths(toy_dir, out), *flags],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=600,
    )
    return proc, out


@pytest.mark.slow
def test_recipe_runs_under_accelerate_launch_with_the_training_module(accelerate_reward_run):
    proc, out = accelerate_reward_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _assert_dynamic_beta_halves(_log_history(out, 2), 2)


@pytest.mark.slow
def test_the_recipe_trains_with_the_kl_in_the_reward_set_in_its_yaml(accelerate_reward_run):
    proc, out = accelerate_reward_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    history = _log_history(out, 2)
    _assert_dynamic_beta_halves(history, 2)  # the dynamic controller acts as with the KL in the loss
    penalties = [h["adaptive_kl/kl_penalty"] for h in history if "adaptive_kl/kl_penalty" in h]
    assert len(penalties) == 2 and all(p is not None for p in penalties)


@pytest.mark.parametrize(
    "where, field, value, allowed",
    [
        ("yaml", "dynamic_beta_decay", "1.5", "(0, 1]"),
        ("flag", "kl_adaptation_method", "dynamc", "dynamic"),
        ("yaml", "kl_placement", "rewards", "['loss', 'reward']"),
    ],
)
def test_a_bad_field_value_stops_the_cli_with_an_error_naming_it(toy_dir, tmp_path, monkeypatch, capsys, where, field, value, allowed):
    # In this process, through the function `python -m unsloth_adaptive_kl` and the console script call (one case
    # runs the console script for real below).
    out = tmp_path / "out"
    if where == "yaml":
        with open(RECIPE) as f:
            recipe = f.read()
        assert f"\n{field}: " in recipe
        config = tmp_path / "bad.yaml"
        config.write_text("\n".join(f"{field}: {value}" if line.startswith(f"{field}: ") else line for line in recipe.splitlines()))
        args = ["--config", str(config)]
    else:
        args = ["--config", RECIPE, f"--{field}", value]
    launched = _record_launches(monkeypatch)
    assert cli_main(["grpo", *args, *_paths(toy_dir, out)]) == 2
    err = capsys.readouterr().err  # one line, the package's ValueError's text after the command's name
    assert err.startswith(f"unsloth-adaptive-kl grpo: {field}=") and err.count("\n") == 1, err
    assert field in err and value in err and allowed in err, err
    assert not launched and not out.exists()  # refused while parsing, before any training process started


def _method_error(value: str) -> str:
    """The package's own ValueError text for ``kl_adaptation_method=value`` (what GRPOConfig's check raises)."""
    from unsloth_adaptive_kl.config import parse_method

    with pytest.raises(ValueError) as error:
        parse_method(value)
    return str(error.value)


UNKNOWN_KEY = (
    "unknown key(s) 'kl_adaptaion_method' (did you mean 'kl_adaptation_method'?): not a field of TRL's GRPO script "
    "(GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig, with the adaptive-KL fields) nor an "
    "`accelerate launch` option; allowed: those fields and options (fix or remove the key)"
)
TWO_PROCESSES = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--use_cpu", "true"]


@pytest.mark.parametrize(
    "case",
    ["misspelt yaml key", "misspelt yaml key, 2 processes", "misspelt flag value", "two controllers in the yaml"],
)
def test_the_console_script_refuses_a_bad_argument_in_one_line_with_status_2(tmp_path, case):
    # The installed `unsloth-adaptive-kl` script, end to end. Before, a misspelt YAML key reached accelerate's parser
    # (its ~110-line usage, then "unrecognized arguments: --kl_adaptaion_method"), and a bad value ended a 31-line
    # traceback (status 1). Now the arguments are checked before anything is handed to accelerate: one line on
    # stderr, naming the key (with the closest field) or the field, the value and what is allowed; nothing on stdout
    # (importing the package writes nothing there: `unsloth-adaptive-kl --help` relies on it); nothing trained; the
    # message once, however many processes were asked for.
    out = tmp_path / "out"
    if "misspelt yaml key" in case:
        config = _recipe_with(tmp_path, {"kl_adaptation_method": "kl_adaptaion_method"})
        args = ["--config", config, "--max_steps", "1", *(TWO_PROCESSES if "2 processes" in case else [])]
        expected = f"--config {config}: {UNKNOWN_KEY}"
    elif case == "misspelt flag value":
        args = ["--config", RECIPE, "--kl_adaptation_method", "dynamc", "--max_steps", "1"]
        expected = _method_error("dynamc")
        assert expected.startswith("kl_adaptation_method='dynamc' has unknown part(s) ['dynamc'] (did you mean 'dynamic'?); allowed: one of [")
    else:
        config = _recipe_with(tmp_path, {})
        with open(config) as f:
            text = f.read()
        assert "\nkl_adaptation_method: dynamic+length_normalized\n" in text
        with open(config, "w") as f:
            f.write(text.replace("\nkl_adaptation_method: dynamic+length_normalized\n", "\nkl_adaptation_method: dynamic+target\n"))
        args = ["--config", config, "--max_steps", "1"]
        expected = _method_error("dynamic+target")
        assert expected.startswith("kl_adaptation_method='dynamic+target' names 2 β controllers; allowed: one of [")
    script = os.path.join(BIN, "unsloth-adaptive-kl")  # the installed console script; a venv without it (the version
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "unsloth_adaptive_kl"]  # matrix's): -m
    proc = subprocess.run(
        [*command, "grpo", *args, "--output_dir", str(out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    # the one line, once, last (a library's own warning may come before it: transformers 5.24 warns of a deprecated field)
    assert proc.stderr.endswith(f"unsloth-adaptive-kl grpo: {expected}\n"), proc.stderr[-3000:]
    assert proc.stderr.count("unsloth-adaptive-kl grpo:") == 1
    assert "Traceback" not in proc.stderr and "usage:" not in proc.stderr
    assert proc.stdout == "", proc.stdout[-2000:]
    assert not out.exists()


def _record_launches(monkeypatch) -> list:
    """accelerate's launch_command, which `unsloth-adaptive-kl grpo` calls to start the training processes, records
    its arguments instead: a case that should be refused while parsing starts nothing even where it is not."""
    import accelerate.commands.launch

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    return launched


def test_grpo_refuses_to_run_when_the_patch_failed_at_import(tmp_path):
    # The package's import tolerates a failed patch for `doctor` only (same trick as tests/test_doctor.py).
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n"
        "_version = m.version\n"
        "m.version = lambda name: '9.0.0' if name == 'trl' else _version(name)\n"
    )
    env = _env()
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"
    env.pop("UNSLOTH_ADAPTIVE_KL_ALLOW_UNTESTED", None)
    proc = subprocess.run(
        [sys.executable, "-m", "unsloth_adaptive_kl", "grpo", "--config", RECIPE], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert proc.returncode != 0 and "trl 9.0.0" in proc.stderr, proc.stderr[-2000:]
    assert "PatchError" in proc.stderr


def _trl_cli_launcher():
    """TRL's CLI launcher module (TRL >= 0.29); skips on an older TRL, whose CLI has none: there `grpo` launches the
    training module itself (test_grpo_without_trls_launcher_launches_the_training_module_itself)."""
    import trl

    try:
        from trl.cli import accelerate_launcher
    except ImportError:
        pytest.skip(f"trl {trl.__version__}'s CLI has no launcher to swap the training module into")
    return accelerate_launcher


def test_grpo_runs_trls_cli_and_launches_the_training_module_with_the_same_arguments(monkeypatch):
    import accelerate.commands.launch

    accelerate_launcher = _trl_cli_launcher()

    from unsloth_adaptive_kl import trl_grpo

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    original = accelerate_launcher.launch_training_script
    argv = ["--config", RECIPE, "--max_steps", "1", "--num_processes", "1", "--kl_estimator", "k1"]
    assert trl_grpo.launch(argv) == 0
    (args,) = launched
    assert args.module and args.training_script == "unsloth_adaptive_kl.trl_grpo"
    assert args.num_processes == 1  # accelerate's flag went to accelerate...
    assert args.training_script_args == ["--config", RECIPE, "--max_steps", "1", "--kl_estimator", "k1"]  # ...the rest to the script
    assert accelerate_launcher.launch_training_script is original  # TRL's launcher is back


@pytest.mark.parametrize("yaml_keys", [False, True])
def test_grpo_without_trls_launcher_launches_the_training_module_itself(monkeypatch, tmp_path, yaml_keys):
    """TRL 0.24-0.29's CLI has no launcher to swap the module into (`grpo` failed there with an ImportError): the
    command launches it itself, as TRL 1.x's CLI would: accelerate's options (the command line's, and the YAML's keys
    that are accelerate options, `accelerate_config NAME` as TRL's config file) to accelerate, the rest to the module.
    Run on every TRL (the fallback is called as the command calls it when the import fails)."""
    import accelerate.commands.launch
    from importlib import resources

    from unsloth_adaptive_kl import trl_grpo

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    config = _recipe_with(tmp_path, {}, extra="num_processes: 1\naccelerate_config: multi_gpu\n") if yaml_keys else RECIPE
    argv = ["--config", config, "--max_steps", "1", "--mixed_precision=no", "--num_processes", "1", "--kl_estimator", "k1"]
    _parsed, launcher_args = trl_grpo._parse(argv, prog=trl_grpo.COMMAND_PROG, launcher_flags=True)
    assert trl_grpo._launch_directly(argv, launcher_args) == 0
    (args,) = launched
    assert args.module and args.training_script == "unsloth_adaptive_kl.trl_grpo"
    assert args.num_processes == 1 and args.mixed_precision == "no"  # accelerate's flags went to accelerate...
    assert args.training_script_args == ["--config", config, "--max_steps", "1", "--kl_estimator", "k1"]  # ...the rest to the module
    if yaml_keys:  # TRL's own accelerate config, by name, as accelerate's --config_file
        assert args.config_file == str(resources.files("trl.accelerate_configs").joinpath("multi_gpu.yaml"))


@pytest.mark.parametrize("value", ["true", "false"])
def test_a_yaml_accelerate_switch_reaches_accelerate_as_a_flag_on_every_trl(monkeypatch, tmp_path, value):
    """`multi_gpu: true` in the YAML: TRL's parser hands it on as `--multi_gpu True`, which accelerate's parser read as
    the script to run ('True', the training module then an argument of it). Now the switch alone (or nothing, for
    false), on both paths: TRL's launcher (TRL >= 0.29, where present) and the command's own launch (every TRL)."""
    from unsloth_adaptive_kl import trl_grpo

    launched = _record_launches(monkeypatch)
    config = _recipe_with(tmp_path, {}, extra=f"multi_gpu: {value}\nnum_processes: 1\n")
    argv = ["--config", config, "--max_steps", "1"]
    _parsed, launcher_args = trl_grpo._parse(argv, prog=trl_grpo.COMMAND_PROG, launcher_flags=True)
    assert trl_grpo._launch_directly(argv, launcher_args) == 0
    try:
        _trl_cli_launcher()
        assert trl_grpo.launch(argv) == 0
    except pytest.skip.Exception:  # TRL 0.24-0.28: no launcher of TRL's to go through
        pass
    assert launched
    for args in launched:
        assert args.module and args.training_script == "unsloth_adaptive_kl.trl_grpo"
        assert args.multi_gpu is (value == "true") and args.num_processes == 1
        assert args.training_script_args == ["--config", config, "--max_steps", "1"]


def test_a_yaml_accelerate_switch_with_a_value_that_is_no_boolean_is_refused_naming_it(monkeypatch, tmp_path, capsys):
    launched = _record_launches(monkeypatch)
    config = _recipe_with(tmp_path, {}, extra="multi_gpu: 2\n")
    assert cli_main(["grpo", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("unsloth-adaptive-kl grpo: multi_gpu='2': an `accelerate launch` switch takes no value; allowed: true or false") and err.count("\n") == 1, err
    assert not launched


def test_grpo_refuses_a_trl_cli_that_no_longer_looks_up_the_launcher(monkeypatch):
    _trl_cli_launcher()
    from trl.cli.commands.training import TrainingCommand

    from unsloth_adaptive_kl import trl_grpo

    monkeypatch.setattr(TrainingCommand, "run", lambda self, args, context: 0)
    with pytest.raises(RuntimeError, match="launch_training_script"):
        trl_grpo.launch(["--config", RECIPE])


def _recipe_with(tmp_path, replace: dict[str, str], extra: str = "") -> str:
    """The recipe with keys renamed (``old -> new``, value kept) and lines appended."""
    with open(RECIPE) as f:
        lines = f.read().splitlines()
    for old, new in replace.items():
        assert any(line.startswith(f"{old}: ") for line in lines), old
        lines = [f"{new}: {line.split(': ', 1)[1]}" if line.startswith(f"{old}: ") else line for line in lines]
    config = tmp_path / "recipe.yaml"
    config.write_text("\n".join(lines) + "\n" + extra)
    return str(config)


@pytest.mark.parametrize("entry", ["accelerate launch -m unsloth_adaptive_kl.trl_grpo", "unsloth-adaptive-kl grpo"])
def test_a_misspelt_yaml_key_is_refused_by_every_entry_point_naming_it(toy_dir, tmp_path, monkeypatch, capsys, entry):
    # Before the fix, the training module parsed with fail_with_unknown_args=False: under `accelerate launch`
    # this recipe exited 0 and trained kl_adaptation_method='none'. In this process, through the function each entry
    # point runs: the training module's train() (what `accelerate launch -m` starts, run for real below) and
    # __main__.main (`python -m unsloth_adaptive_kl`, the console script).
    config = _recipe_with(tmp_path, {"kl_adaptation_method": "kl_adaptaion_method"})
    out = tmp_path / "out"
    argv = ["--config", config, *_paths(toy_dir, out), "--max_steps", "1"]
    if entry.startswith("accelerate"):
        from trl.scripts import grpo

        from unsloth_adaptive_kl import trl_grpo

        trained = []
        monkeypatch.setattr(grpo, "main", lambda *args: trained.append(args))
        with pytest.raises(ValueError, match=r"unknown key\(s\) 'kl_adaptaion_method' \(did you mean 'kl_adaptation_method'\?\)"):
            trl_grpo.train(argv)
        assert not trained
    else:
        launched = _record_launches(monkeypatch)
        # Before, accelerate's parser refused the key TRL's CLI handed it (SystemExit 2, after its whole usage).
        assert cli_main(["grpo", *argv]) == 2
        assert capsys.readouterr().err == f"unsloth-adaptive-kl grpo: --config {config}: {UNKNOWN_KEY}\n"
        assert not launched
    assert not out.exists()  # refused before any training


def test_accelerate_launch_of_the_training_module_exits_non_zero_on_a_misspelt_yaml_key(toy_dir, tmp_path):
    # The accelerate case above, end to end: accelerate launch starts the training module, which refuses the key.
    config = _recipe_with(tmp_path, {"kl_adaptation_method": "kl_adaptaion_method"})
    out = tmp_path / "out"
    command = [os.path.join(BIN, "accelerate"), "launch", "--num_processes", "1", "-m", "unsloth_adaptive_kl.trl_grpo"]
    proc = subprocess.run(
        [*command, "--config", config, *_paths(toy_dir, out), "--max_steps", "1"],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # The training module's one line (status 2), then accelerate's own report of the failed process (its
    # CalledProcessError traceback: accelerate's, without --quiet); no traceback through the training module.
    assert f"python -m unsloth_adaptive_kl.trl_grpo: --config {config}: {UNKNOWN_KEY}" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "returned non-zero exit status 2" in proc.stderr and 'trl_grpo.py", line' not in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()  # refused before any training


def test_the_training_module_prints_a_refused_argument_in_one_line_and_lets_a_crash_through(tmp_path, monkeypatch, capsys):
    # What `python -m unsloth_adaptive_kl.trl_grpo` (each process accelerate starts) runs: trl_grpo.main. A refused
    # argument is one line and status 2; any other exception, a ValueError in training included, keeps its traceback.
    from trl.scripts import grpo

    from unsloth_adaptive_kl import trl_grpo

    config = _recipe_with(tmp_path, {"kl_adaptation_method": "kl_adaptaion_method"})
    assert trl_grpo.main(["--config", config, "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"python -m unsloth_adaptive_kl.trl_grpo: --config {config}: {UNKNOWN_KEY}\n"
    assert trl_grpo.main(["--config", RECIPE, "--kl_adaptation_method", "dynamc", "--output_dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"python -m unsloth_adaptive_kl.trl_grpo: {_method_error('dynamc')}\n"
    assert trl_grpo.main(["--config", RECIPE, "--num_processes", "1", "--output_dir", str(tmp_path / "out")]) == 2
    assert "unknown flag(s) '--num_processes'" in capsys.readouterr().err  # accelerate's options go before -m

    def crash(*args):
        raise ValueError("a crash in training")

    monkeypatch.setattr(grpo, "main", crash)
    with pytest.raises(ValueError, match="a crash in training"):
        trl_grpo.main(["--config", RECIPE, "--output_dir", str(tmp_path / "out")])


def test_grpo_refuses_a_misspelt_flag_naming_the_closest_field_or_accelerate_option(monkeypatch, capsys):
    # Before, accelerate's parser refused these after printing its whole usage. accelerate's own flags still pass.
    launched = _record_launches(monkeypatch)
    for flag, closest in [("--kl_adaptaion_method", "--kl_adaptation_method"), ("--num_proceses", "--num_processes")]:
        assert cli_main(["grpo", "--config", RECIPE, flag, "2"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"unsloth-adaptive-kl grpo: unknown flag(s) '{flag}' (did you mean '{closest}'?): ") and err.count("\n") == 1, err
    assert not launched


def test_the_training_module_lets_accelerate_keys_of_the_yaml_through_and_refuses_the_rest(toy_dir, tmp_path):
    from unsloth_adaptive_kl import trl_grpo

    # `trl grpo` hands accelerate's keys of the YAML to the launcher: a training process sees them too.
    launcher_keys = "num_processes: 1\nmixed_precision: \"no\"\naccelerate_config: multi_gpu\n"
    config = _recipe_with(tmp_path, {}, launcher_keys)
    _, training_args, _, _ = trl_grpo.parse(["--config", config, *_paths(toy_dir, tmp_path / "out")])
    assert training_args.kl_adaptation_method == "dynamic+length_normalized" and training_args.beta == BETA
    bad = _recipe_with(tmp_path, {"reward_window": "reward_windows"}, launcher_keys)
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'reward_windows' \(did you mean 'reward_window'\?\)"):
        trl_grpo.parse(["--config", bad, *_paths(toy_dir, tmp_path / "out")])


def test_grpo_help_names_this_command(capsys):
    assert cli_main(["grpo", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: unsloth-adaptive-kl grpo ") and "--kl_adaptation_method" in out


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_commands_to_stdout_and_exits_zero(capsys, flag):
    # issue 39, item 8: before, `unsloth-adaptive-kl --help` wrote the usage to stderr and exited 2. In this process,
    # through the function python -m and the console script call (a process returns what it returns: the training
    # runs exit 0 through python -m); that importing the package prints nothing to stdout is checked on the console
    # script's process (test_the_console_script_stops_on_a_bad_field_value_with_the_error_naming_it).
    assert cli_main([flag]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: unsloth-adaptive-kl {doctor,grpo}") and "doctor" in captured.out and "grpo" in captured.out
    assert "usage" not in captured.err


def test_the_refusals_docs_cli_md_quotes_are_what_the_command_prints(tmp_path, monkeypatch, capsys):
    # docs/cli.md's ```text block: each `$ unsloth-adaptive-kl grpo ...` line run (in this process, through the function
    # the console script calls; typo.yaml is the recipe with the misspelt key, recipe.yaml the recipe), and what it
    # prints on stderr is the line the page shows under it.
    import re
    import shlex

    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        (block,) = re.findall(r"```text\n(.*?)```", f.read(), re.DOTALL)
    lines = block.splitlines()
    commands = [(i, line) for i, line in enumerate(lines) if line.startswith("$ ")]
    assert len(commands) == 3 and len(lines) == 6
    monkeypatch.chdir(tmp_path)
    with open(_recipe_with(tmp_path, {"kl_adaptation_method": "kl_adaptaion_method"})) as f:
        (tmp_path / "typo.yaml").write_text(f.read())
    with open(RECIPE) as f:
        (tmp_path / "recipe.yaml").write_text(f.read())
    launched = _record_launches(monkeypatch)
    for i, line in commands:
        program, command, *args = shlex.split(line[2:], comments=True)
        assert (program, command) == ("unsloth-adaptive-kl", "grpo")
        assert cli_main([command, *args]) == 2
        assert capsys.readouterr().err == lines[i + 1] + "\n"
    assert not launched


def test_a_missing_config_file_is_one_line_with_status_2(tmp_path, capsys):
    """It was a FileNotFoundError traceback from TRL's parser."""
    from unsloth_adaptive_kl import trl_grpo

    missing = str(tmp_path / "nope.yaml")
    assert trl_grpo.launch(["--config", missing, "--max_steps", "1"]) == 2
    assert capsys.readouterr().err == f"unsloth-adaptive-kl grpo: --config {missing}: no such file; allowed: the path of a YAML file\n"
    assert trl_grpo.main(["--config", missing]) == 2
    assert capsys.readouterr().err == f"python -m unsloth_adaptive_kl.trl_grpo: --config {missing}: no such file; allowed: the path of a YAML file\n"

"""TRL's GRPO command line with the adaptive-KL fields: examples/grpo_recipe.yaml run for a few
steps on the CPU through ``python -m unsloth_adaptive_kl grpo`` (TRL's CLI entry, which starts the
training module through ``accelerate launch``) and through ``accelerate launch -m
unsloth_adaptive_kl.trl_grpo``; bad field values stop it with an error naming the field.

Subprocesses are what cost here (each imports torch, transformers and TRL, ~9 s of CPU), so the cases that check
parsing and validation call, in this process, the function an entry point runs with the same arguments
(``__main__.main`` for ``python -m unsloth_adaptive_kl`` and the ``unsloth-adaptive-kl`` script, ``trl_grpo.train``
for the processes ``accelerate launch`` starts), and each entry point also runs for real: ``python -m`` trains (one
and two processes) and refuses to start on a failed patch, the console script refuses a bad field value (printing
nothing to stdout), ``accelerate launch`` trains and refuses a misspelt YAML key."""

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
def test_a_bad_field_value_stops_the_cli_with_an_error_naming_it(toy_dir, tmp_path, monkeypatch, where, field, value, allowed):
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
    with pytest.raises(ValueError) as error:
        cli_main(["grpo", *args, *_paths(toy_dir, out)])
    message = str(error.value)  # the last line of the traceback a process prints: one line
    assert "\n" not in message and field in message and value in message and allowed in message, message
    assert not launched and not out.exists()  # refused while parsing, before any training process started


def test_the_console_script_stops_on_a_bad_field_value_with_the_error_naming_it(toy_dir, tmp_path):
    # The installed `unsloth-adaptive-kl` script, end to end, on the flag case above: it exits non-zero with the
    # ValueError as the last line it prints, and nothing on stdout (neither importing the package nor the refusal
    # writes there: `unsloth-adaptive-kl --help` relies on the first to print only its usage).
    out = tmp_path / "out"
    proc = subprocess.run(
        [os.path.join(BIN, "unsloth-adaptive-kl"), "grpo", "--config", RECIPE, "--kl_adaptation_method", "dynamc", *_paths(toy_dir, out)],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=300,
    )
    assert proc.returncode != 0
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("ValueError:") and "kl_adaptation_method" in last_line and "dynamc" in last_line, proc.stderr[-2000:]
    assert "dynamic" in last_line, proc.stderr[-2000:]
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


def test_grpo_runs_trls_cli_and_launches_the_training_module_with_the_same_arguments(monkeypatch):
    import accelerate.commands.launch
    from trl.cli import accelerate_launcher

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


def test_grpo_refuses_a_trl_cli_that_no_longer_looks_up_the_launcher(monkeypatch):
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
        with pytest.raises(SystemExit) as error:  # accelerate's parser refuses the key TRL's CLI hands it
            cli_main(["grpo", *argv])
        assert error.value.code != 0
        assert "kl_adaptaion_method" in capsys.readouterr().err
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
    assert "kl_adaptaion_method" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()  # refused before any training


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

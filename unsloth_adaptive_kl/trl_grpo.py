"""TRL's GRPO command line with the adaptive-KL fields.

``unsloth-adaptive-kl grpo ARGS`` is ``trl grpo ARGS``: TRL's own CLI entry (``trl.cli.main``)
parses the flags and the ``--config`` YAML, resolves ``--accelerate_config`` and starts the
training processes through ``accelerate launch``. One thing differs: each process runs this
module (``python -m unsloth_adaptive_kl.trl_grpo``) instead of ``trl/scripts/grpo.py``. The
module imports this package, then calls TRL's own ``make_parser()`` and ``main()`` of that script.

Why not ``import unsloth_adaptive_kl`` and call ``trl.cli.main`` as it is: TRL starts
``trl/scripts/grpo.py`` in new processes, and nothing there imports this package, so there
``GRPOConfig`` has none of the fields (TRL's script parses its YAML with
``fail_with_unknown_args=False``: a field in the YAML would be dropped without a word).
TRL's CLI has no option to name another script, so for the duration of the call this replaces
``trl.cli.accelerate_launcher.launch_training_script``, which ``TrainingCommand.run`` looks up when
it runs (checked before it is relied on, and that the replacement was called after).

Under ``accelerate launch`` directly, run the training module itself:
``accelerate launch [accelerate flags] -m unsloth_adaptive_kl.trl_grpo --config recipe.yaml``.
"""

from __future__ import annotations

import sys

#: What each process started by ``unsloth-adaptive-kl grpo`` runs (``python -m`` style).
TRAINING_MODULE = __name__ if __name__ != "__main__" else "unsloth_adaptive_kl.trl_grpo"


def _require_patch() -> None:
    """Started as ``python -m unsloth_adaptive_kl`` or ``unsloth-adaptive-kl``, the package's import
    keeps a failed patch in ``IMPORT_PATCH_ERROR`` instead of raising (so that ``doctor`` can report
    it); training must not go on without the patch."""
    import unsloth_adaptive_kl

    if unsloth_adaptive_kl.IMPORT_PATCH_ERROR is not None:
        raise unsloth_adaptive_kl.IMPORT_PATCH_ERROR


def train(argv: list[str] | None = None) -> None:
    """One training process: what ``trl/scripts/grpo.py`` runs, with the package imported first."""
    _require_patch()
    from trl.scripts import grpo

    script_args, training_args, model_args, dataset_args = parse(argv)
    grpo.main(script_args, training_args, model_args, dataset_args)
    _close_process_group()


def parse(argv: list[str] | None) -> tuple:
    """The training process's arguments, as TRL's script parses them, with every YAML key checked.

    TRL's script parses with ``fail_with_unknown_args=False``: a YAML key that is no field is
    dropped without a word (a misspelt ``kl_adaptaion_method`` would train method ``none``). Its
    reason is that the YAML may also hold ``accelerate launch`` options (``num_processes``,
    ``accelerate_config``), which ``trl grpo`` hands to the launcher. Here those, and only those,
    are let through; any other unknown key raises ``ValueError`` naming it. (An unknown flag on
    the command line is refused by the parser itself.)"""
    from trl.scripts import grpo

    parser = grpo.make_parser(prog="python -m unsloth_adaptive_kl.trl_grpo")
    *parsed, config_remaining, _cli_remaining = parser.parse_args_and_config(
        argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    unknown = [key for key in config_remaining[::2] if key not in _launcher_options()]
    if unknown:
        import difflib

        known = [action.dest for action in parser._actions if action.option_strings]
        hints = {key[2:]: difflib.get_close_matches(key[2:], known, n=1) for key in unknown}
        described = ", ".join(f"{key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "") for key, hint in hints.items())
        raise ValueError(
            f"--config: unknown key(s) {described}: not a field of TRL's GRPO script (GRPOScriptArguments, GRPOConfig, "
            "ModelConfig, DatasetMixtureConfig, with the adaptive-KL fields) nor an `accelerate launch` option; "
            "allowed: those fields and options (fix or remove the key)"
        )
    if _cli_remaining:  # the parser refuses these itself; kept as a guard should TRL's parser change
        raise ValueError(f"unknown argument(s) {_cli_remaining}; allowed: the fields of TRL's GRPO script")
    return tuple(parsed)


def _launcher_options() -> set[str]:
    """The ``--name`` options of ``accelerate launch``, and TRL's ``--accelerate_config``: YAML keys
    that ``trl grpo`` passes to the launcher, so a training process may find them in its YAML."""
    from accelerate.commands.launch import launch_command_parser

    options = {option for action in launch_command_parser()._actions for option in action.option_strings}
    underscored = {"--" + option[2:].replace("-", "_") for option in options if option.startswith("--")}
    return options | underscored | {"--accelerate_config"}


def _close_process_group() -> None:
    """Tear down the distributed process group that accelerate opened, before the interpreter exits.

    TRL's script leaves it to exit; with 2 processes on gloo, a rank then sometimes aborted after
    training had finished and saved ("terminate called without an active exception", SIGABRT: seen
    once in CI), which turns a finished run into a failed command."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def launch(argv: list[str]) -> int:
    """``unsloth-adaptive-kl grpo ARGS``: ``trl grpo ARGS`` launching :data:`TRAINING_MODULE`.

    The arguments are parsed here first, with the fields in place: a bad value stops the command
    before any process starts, with the ``ValueError`` naming the field."""
    import subprocess

    _require_patch()
    if "-h" in argv or "--help" in argv:  # TRL's CLI would print its own name ("usage: trl grpo")
        from trl.scripts import grpo

        grpo.make_parser(prog="unsloth-adaptive-kl grpo").print_help()
        return 0
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli import accelerate_launcher, main as trl_main
    from trl.cli.commands.training import TrainingCommand

    # TRL's TrainingCommand.run imports launch_training_script from accelerate_launcher when it runs;
    # that lookup is where the training module is swapped in. Check it is still there.
    if "launch_training_script" not in TrainingCommand.run.__code__.co_names:
        import trl

        raise RuntimeError(
            f"trl {trl.__version__}: TrainingCommand.run no longer calls launch_training_script; "
            "unsloth-adaptive-kl grpo cannot start its training module through TRL's CLI. "
            "Use: accelerate launch -m unsloth_adaptive_kl.trl_grpo --config recipe.yaml"
        )
    launched = []

    def launch_training_module(script_name: str, launch_args: list[str], training_script_args: list[str], **_):
        if script_name != "grpo.py":
            raise RuntimeError(f"unsloth-adaptive-kl grpo was asked to launch {script_name!r}, not TRL's grpo.py")
        launched.append(script_name)
        launch_command(launch_command_parser().parse_args([*launch_args, "--module", TRAINING_MODULE, *training_script_args]))

    original = accelerate_launcher.launch_training_script
    accelerate_launcher.launch_training_script = launch_training_module
    try:
        status = trl_main(["grpo", *argv])
    except subprocess.CalledProcessError as error:  # a training process failed; its output is above
        return error.returncode or 1
    finally:
        accelerate_launcher.launch_training_script = original
    if not launched:
        raise RuntimeError("TRL's CLI returned without launching the GRPO training module")
    return status


if __name__ == "__main__":
    train(sys.argv[1:])

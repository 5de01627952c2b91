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

One check of the arguments, :func:`parse`, serves both: ``unsloth-adaptive-kl grpo`` runs it before it hands
anything to accelerate, each training process before it trains. A refused argument (a YAML key or a flag that is
no field, a bad value) is an :class:`ArgumentsError`, printed as one line with exit status 2, without a traceback.
"""

from __future__ import annotations

import functools
import os
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
    """One training process: what ``trl/scripts/grpo.py`` runs, with the package imported first.
    Raises :class:`ArgumentsError` on a refused argument, before any training."""
    _require_patch()
    from trl.scripts import grpo

    script_args, training_args, model_args, dataset_args = parse(argv)
    grpo.main(script_args, training_args, model_args, dataset_args)
    _close_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m unsloth_adaptive_kl.trl_grpo ARGS`` (what ``accelerate launch`` starts in each process): :func:`train`,
    a refused argument printed as one line (per process) with exit status 2 instead of a traceback."""
    try:
        train(argv)
    except ArgumentsError as error:
        return refuse(TRAINING_PROG, error)
    return 0


#: ``prog`` of the training module, and of the command that launches it, in their messages.
TRAINING_PROG = "python -m unsloth_adaptive_kl.trl_grpo"
COMMAND_PROG = "unsloth-adaptive-kl grpo"

#: The exit status on a refused argument (argparse's, and the ``unsloth-adaptive-kl`` command's, for usage errors).
USAGE_ERROR = 2

_FIELDS = (
    "TRL's GRPO script (GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig, with the adaptive-KL fields)"
)


class ArgumentsError(ValueError):
    """A refused argument of the GRPO command line: a ``--config`` key or a flag that is no field (nor an
    ``accelerate launch`` option, where those are allowed), or a bad value: the ``ValueError`` raised while the
    arguments are parsed and the configs built (``GRPOConfig.__post_init__`` runs this package's validation, which
    names the field, the value and what is allowed), its text kept. The command lines print it as one line,
    ``PROG: MESSAGE``, and exit with :data:`USAGE_ERROR` (:func:`refuse`); any other exception keeps its traceback."""


def refuse(prog: str, error: ArgumentsError) -> int:
    """Print ``error`` as one line on stderr, after ``prog``, and return :data:`USAGE_ERROR` (no traceback)."""
    print(f"{prog}: {error}", file=sys.stderr)
    return USAGE_ERROR


def parse(argv: list[str] | None, *, prog: str = TRAINING_PROG, launcher_flags: bool = False) -> tuple:
    """The training process's arguments, as TRL's script parses them, with every YAML key and flag checked.

    TRL's script parses with ``fail_with_unknown_args=False``: a YAML key that is no field is
    dropped without a word (a misspelt ``kl_adaptaion_method`` would train method ``none``). Its
    reason is that the YAML may also hold ``accelerate launch`` options (``num_processes``,
    ``accelerate_config``), which ``trl grpo`` hands to the launcher. Here those, and only those,
    are let through; any other unknown key is refused, by name, as soon as TRL's parser has read the YAML
    (before the configs are built: a value check that the missing field fails would name the wrong thing).

    ``launcher_flags``: the command line may also hold ``accelerate launch`` options (``unsloth-adaptive-kl grpo``,
    which checks its arguments here before it launches anything); otherwise every flag must be a field.

    Raises :class:`ArgumentsError` (a ``ValueError``) for an unknown key or flag, and for a bad value."""
    parsed, _launch = _parse(argv, prog=prog, launcher_flags=launcher_flags)
    return parsed


def _grpo_parser(prog: str):
    """TRL's GRPO parser named ``prog``: ``make_parser(prog=...)`` from TRL 1.0, before it ``make_parser()`` (0.24-0.29),
    its ``prog`` then set on it."""
    import inspect

    from trl.scripts import grpo

    if "prog" in inspect.signature(grpo.make_parser).parameters:
        return grpo.make_parser(prog=prog)
    parser = grpo.make_parser()
    parser.prog = prog
    return parser


def _parse(argv: list[str] | None, *, prog: str, launcher_flags: bool) -> tuple[tuple, list[str]]:
    """:func:`parse`, and the ``accelerate launch`` options among the arguments (``--name value`` strings: the YAML's
    keys, then the command line's flags, which accelerate's parser lets override them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None  # where TRL's parser finds it
    if config is not None and not os.path.isfile(config):
        raise ArgumentsError(f"--config {config}: no such file; allowed: the path of a YAML file")
    parser = _grpo_parser(prog)
    set_defaults_with_config = parser.set_defaults_with_config
    from_config: list[list[str]] = []

    def set_defaults_and_check_keys(**values):  # TRL's parser calls this with the YAML, before building the configs
        remaining = set_defaults_with_config(**values)
        _check_config_keys(parser, config, remaining)
        from_config.append(list(remaining))
        return remaining

    parser.set_defaults_with_config = set_defaults_and_check_keys
    try:
        # Every TRL returns the YAML's leftover strings, then the command line's, as one list (TRL >= 1.0 can also
        # separate them; 0.24-0.29 cannot): the YAML's part is what the hook above saw.
        *parsed, remaining = parser.parse_args_and_config(argv, return_remaining_strings=True)
    except ArgumentsError:
        raise
    except ValueError as error:  # a bad value: the field's own check, while the configs are built
        raise ArgumentsError(str(error)) from error
    if config is not None and not from_config:  # TRL's parser no longer calls the hook: the leftovers cannot be split
        import trl

        raise RuntimeError(
            f"trl {trl.__version__}: TrlParser.parse_args_and_config no longer calls set_defaults_with_config with the "
            "--config YAML; the YAML's keys cannot be checked"
        )
    config_remaining = from_config[0] if from_config else []
    cli_remaining = remaining[len(config_remaining):]
    _check_flags(parser, cli_remaining, launcher_flags)
    return tuple(parsed), _accelerate_switches([*config_remaining, *cli_remaining])


_TRUE, _FALSE = {"true", "yes", "on", "1"}, {"false", "no", "off", "0"}


def _accelerate_switches(args: list[str]) -> list[str]:
    """``args`` (``accelerate launch`` options) with each option that takes no value (``--multi_gpu``) given as accelerate
    takes it: alone, or dropped when false. A YAML's ``multi_gpu: true`` reaches here as ``--multi_gpu True`` (TRL's parser
    writes each leftover key as ``--key str(value)``); handed on as such, accelerate's parser takes ``True`` for the
    script to run. A value that is no boolean raises :class:`ArgumentsError`."""
    takes_value = _launcher_takes_value()
    out, at = [], 0
    while at < len(args):
        token = args[at]
        name, equals, value = token.partition("=")
        at += 1
        if takes_value.get(name, True):
            out.append(token)
            continue
        if not equals and at < len(args) and not args[at].startswith("-"):
            value, equals, at = args[at], "=", at + 1
        if equals and value.lower() not in _TRUE | _FALSE:
            raise ArgumentsError(
                f"{name[2:]}={value!r}: an `accelerate launch` switch takes no value; allowed: true or false (or the "
                f"flag {name} alone)"
            )
        if not equals or value.lower() in _TRUE:
            out.append(name)
    return out


def _check_config_keys(parser, config: str | None, remaining: list[str]) -> None:
    """The ``--config`` YAML's keys that no field took (``remaining``: ``--key value`` pairs, as TRL's parser returns
    them) must be ``accelerate launch`` options; ArgumentsError naming the others, with the closest field."""
    allowed = _launcher_options()
    unknown = [key[2:] for key in remaining[::2] if key not in allowed]
    if unknown:
        raise _unknown(parser, f"--config {config}: unknown key(s)", unknown, what="key")


def _check_flags(parser, remaining: list[str], launcher_flags: bool) -> None:
    """The command line's strings that no field took (``remaining``): with ``launcher_flags``, every flag among them must
    be an ``accelerate launch`` option (the strings between are its values, for accelerate's parser); without, there
    must be none. ArgumentsError naming the unknown flags, each with the closest field or option."""
    flags = [token.split("=", 1)[0] for token in remaining if token.startswith("-") and not _is_number(token)]
    allowed = _launcher_options() if launcher_flags else set()
    unknown = [flag for flag in flags if flag not in allowed]
    if unknown:
        raise _unknown(parser, "unknown flag(s)", unknown, what="flag", dashes="--", launcher=launcher_flags)
    if remaining and not launcher_flags:  # values without a flag
        raise ArgumentsError(f"unexpected argument(s) {remaining}; allowed: the fields of {_FIELDS}, as --name value")


def _unknown(parser, described: str, names: list[str], *, what: str, dashes: str = "", launcher: bool = True) -> ArgumentsError:
    """The refusal of unknown keys or flags ``names`` (as given), each with the closest known name (after ``dashes``)."""
    import difflib

    known = [action.dest for action in parser._actions if action.option_strings]
    if launcher:
        known += sorted({option[2:].replace("-", "_") for option in _launcher_options() if option.startswith("--")})
    hints = {name: difflib.get_close_matches(name.lstrip("-"), known, n=1) for name in names}
    named = ", ".join(f"{name!r}" + (f" (did you mean '{dashes}{hint[0]}'?)" if hint else "") for name, hint in hints.items())
    if launcher:
        return ArgumentsError(
            f"{described} {named}: not a field of {_FIELDS} nor an `accelerate launch` option; "
            f"allowed: those fields and options (fix or remove the {what})"
        )
    return ArgumentsError(
        f"{described} {named}: not a field of {_FIELDS}; allowed: those fields (fix or remove the {what}; "
        f"accelerate's options go before `-m {TRAINING_MODULE}`)"
    )


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _launcher_options() -> set[str]:
    """The ``--name`` options of ``accelerate launch``, and TRL's ``--accelerate_config``: YAML keys
    that ``trl grpo`` passes to the launcher, so a training process may find them in its YAML."""
    return set(_launcher_takes_value())


@functools.cache
def _launcher_takes_value() -> dict[str, bool]:
    """Each option of :func:`_launcher_options` -> whether it takes a value (``--multi_gpu`` takes none): from
    accelerate's own parser, made once (it is asked several times a command line)."""
    from accelerate.commands.launch import launch_command_parser

    takes_value = {option: action.nargs != 0 for action in launch_command_parser()._actions for option in action.option_strings}
    takes_value.update({"--" + o[2:].replace("-", "_"): v for o, v in list(takes_value.items()) if o.startswith("--")})
    return {**takes_value, "--accelerate_config": True}


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

    The arguments are parsed here first, with the fields in place and the training module's checks (:func:`parse`:
    every YAML key and flag a field or an ``accelerate launch`` option, every value valid): a refused argument stops
    the command before anything is handed to accelerate, printed as one line (``unsloth-adaptive-kl grpo: MESSAGE``),
    with exit status 2."""
    import subprocess

    _require_patch()
    if "-h" in argv or "--help" in argv:  # TRL's CLI would print its own name ("usage: trl grpo")
        _grpo_parser(COMMAND_PROG).print_help()
        return 0
    try:
        _parsed, launcher_args = _parse(argv, prog=COMMAND_PROG, launcher_flags=True)
    except ArgumentsError as error:
        return refuse(COMMAND_PROG, error)
    from accelerate.commands.launch import launch_command, launch_command_parser

    try:
        from trl.cli import accelerate_launcher, main as trl_main
        from trl.cli.commands.training import TrainingCommand
    except ImportError:  # TRL 0.24-0.29: a CLI module without the launcher this command swaps its module into
        return _launch_directly(argv, launcher_args)

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
        launch_args = _accelerate_switches(launch_args)  # TRL hands on a YAML's `multi_gpu: true` as `--multi_gpu True`
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


def _launch_directly(argv: list[str], launcher_args: list[str]) -> int:
    """``accelerate launch [launcher_args] -m TRAINING_MODULE [the other arguments]``, for a TRL whose CLI has no launcher
    to swap the module into (0.24-0.29). ``launcher_args``: the ``accelerate launch`` options of the YAML and of the
    command line (:func:`_parse`), TRL's ``--accelerate_config NAME`` turned into accelerate's ``--config_file`` (a
    file, or one of TRL's own configs), as ``trl grpo`` of TRL 1.x does; each training process reads the YAML again."""
    import subprocess
    from importlib import resources

    from accelerate.commands.launch import launch_command, launch_command_parser

    args = list(launcher_args)
    if "--accelerate_config" in args:
        at = args.index("--accelerate_config")
        name = args[at + 1]
        path = name if os.path.isfile(name) else resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")
        if not os.path.isfile(str(path)):
            print(f"{COMMAND_PROG}: accelerate_config={name!r} is neither a file nor one of TRL's accelerate configs; "
                  "allowed: a file, or a name in trl/accelerate_configs", file=sys.stderr)
            return USAGE_ERROR
        args[at:at + 2] = ["--config_file", str(path)]
    script_args = _without_launcher_options(argv)
    try:
        launch_command(launch_command_parser().parse_args([*args, "--module", TRAINING_MODULE, *script_args]))
    except subprocess.CalledProcessError as error:  # a training process failed; its output is above
        return error.returncode or 1
    return 0


def _without_launcher_options(argv: list[str]) -> list[str]:
    """``argv`` less its ``--name`` options of :func:`_launcher_options` and their values (``--name value`` or
    ``--name=value``; a flag that takes no value, ``--multi_gpu``, stands alone)."""
    takes_value = _launcher_takes_value()
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name.startswith("--") and name in takes_value:
            skip = "=" not in token and takes_value[name]
            continue
        out.append(token)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

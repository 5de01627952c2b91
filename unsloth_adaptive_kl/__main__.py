"""``python -m unsloth_adaptive_kl COMMAND`` (also installed as ``unsloth-adaptive-kl COMMAND``).

- ``doctor``: what is installed, and whether each backend can work.
- ``grpo``: TRL's ``trl grpo`` with the adaptive-KL fields in its flags and ``--config`` YAML
  (see :mod:`unsloth_adaptive_kl.trl_grpo`).
"""

from __future__ import annotations

import sys

COMMANDS = ("doctor", "grpo")
USAGE = f"usage: unsloth-adaptive-kl {{{','.join(COMMANDS)}}} [options]   (try: doctor --help, grpo --help)"
HELP = f"""{USAGE}

Adaptive KL regularisation for GRPO in TRL, Unsloth and Liger.

commands:
  doctor   what is installed, and whether each backend (trl, unsloth, liger) can work here
  grpo     TRL's `trl grpo` with the adaptive-KL fields in its flags and --config YAML

options:
  -h, --help   show this message and exit
  --version    show the package's version and exit"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):  # asked for: to stdout, exit status 0 (as argparse does)
        print(HELP)
        return 0
    if argv[:1] == ["--version"]:
        from . import __version__

        print(f"unsloth-adaptive-kl {__version__}")
        return 0
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(f"{USAGE}\nunsloth-adaptive-kl: error: unknown command {argv[0]!r}{hint}; allowed: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if argv[0] == "grpo":
        from . import trl_grpo

        return trl_grpo.launch(argv[1:])
    from . import doctor

    return doctor.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

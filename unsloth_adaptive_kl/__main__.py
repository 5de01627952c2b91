"""``python -m unsloth_adaptive_kl COMMAND`` (also installed as ``unsloth-adaptive-kl COMMAND``).

- ``doctor``: what is installed, and whether each backend can work.
- ``grpo``: TRL's ``trl grpo`` with the adaptive-KL fields in its flags and ``--config`` YAML
  (see :mod:`unsloth_adaptive_kl.trl_grpo`).
"""

from __future__ import annotations

import sys

COMMANDS = ("doctor", "grpo")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(
            f"usage: unsloth-adaptive-kl {{{','.join(COMMANDS)}}} [options]   (try: doctor --help, grpo --help)",
            file=sys.stderr,
        )
        return 2
    if argv[0] == "grpo":
        from . import trl_grpo

        return trl_grpo.launch(argv[1:])
    from . import doctor

    return doctor.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

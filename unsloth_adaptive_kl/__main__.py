"""``python -m unsloth_adaptive_kl doctor`` (also installed as ``unsloth-adaptive-kl doctor``)."""

from __future__ import annotations

import sys

COMMANDS = ("doctor",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: unsloth-adaptive-kl {{{','.join(COMMANDS)}}} [options]   (try: doctor --help)", file=sys.stderr)
        return 2
    from . import doctor

    return doctor.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

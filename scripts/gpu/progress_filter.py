"""Passes a mutation run's output through to stdout and to the file ARGV[1], without mutmut's spinner.

mutmut redraws a spinner line with a carriage return about ten times a second, also when its output is no terminal:
in a device call's output tail (its last 12,000 characters) that would leave nothing else. Every other line passes;
of the spinner's lines, each phase's name once (``Running stats``), and of its progress lines (``⠹ 15/1141  🎉 12 ...``)
one every INTERVAL_S seconds and the last one before any other line.

    ... | python scripts/gpu/progress_filter.py LOG
"""

from __future__ import annotations

import codecs
import os
import re
import sys
import time

INTERVAL_S = 20
SPINNER = re.compile("^[\u2800-\u28ff] ")  # a braille pattern and a space: one spinner frame
PROGRESS = re.compile(r"\d+/\d+")


def main() -> None:
    log = open(sys.argv[1], "w")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    state = {"pending": None, "shown": 0.0}

    def emit(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    def handle(frame: str) -> None:
        if SPINNER.match(frame):
            if not PROGRESS.search(frame) and frame[2:].strip() != state.get("title"):  # a phase's name, once
                state["title"] = frame[2:].strip()
                emit(state["title"])
            elif PROGRESS.search(frame):
                state["pending"] = frame
                if time.time() - state["shown"] >= INTERVAL_S:
                    emit(frame)
                    state["pending"], state["shown"] = None, time.time()
        elif frame.strip():
            if state["pending"] is not None:
                emit(state["pending"])
                state["pending"] = None
            emit(frame)

    rest = ""
    while chunk := os.read(0, 65536):
        *frames, rest = re.split("[\r\n]", rest + decoder.decode(chunk))
        for frame in frames:
            handle(frame)
    handle(rest)
    if state["pending"] is not None:
        emit(state["pending"])


if __name__ == "__main__":
    main()

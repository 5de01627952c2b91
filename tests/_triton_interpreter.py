"""The test processes' Triton interpreter without its per-call rebuild of ``triton.language``'s patches.

On a CPU, TRL's fused log-prob kernel (and Liger's kernels) run in Triton's interpreter (TRITON_INTERPRET=1). Before each
kernel launch, and again at every call of a ``@triton.jit`` helper inside a kernel, the interpreter's ``_patch_lang``
walks ``triton.language`` with ``inspect.getmembers`` and builds a fresh wrapper for each of its builtins; the launch
restores them afterwards. Measured over the whole suite (py-spy, 2026-11-29): 126 of the 350 CPU-seconds the
interpreter took went to that walk, not to the kernels. With it gone from the test processes, the suite's CPU time
fell from 1,263 to 954 s (user; one run each on this 2-core machine).

What it sets does not depend on the call: which modules the kernel's globals hold (``triton.language``,
``triton.language.core``) and the interpreter's own module state. So the first call, on an unpatched
``triton.language``, records every ``(object, name, value)`` the walk sets, and later calls set the same values again
through the same :class:`_LangPatchScope` (its restore is unchanged); a call inside a launch, where they are in place
already, sets nothing. The kernels then run on the same patched functions
and give the same results; only the walk is saved. This touches no package code and no library outside the test
processes: a GPU never runs the interpreter.

Installed for Triton 3.9 (the suite's) only; on another release the interpreter is left as it is (slower, equal).
"""

SUPPORTED = ("3.9.",)


def install() -> bool:
    """Replace the interpreter's ``_patch_lang`` by the recording one; True if installed."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return False
    if not version.startswith(SUPPORTED):
        return False
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None or getattr(original, "_uakl_recording", False):
        return False
    recorded = {}

    def _patch_lang(fn):
        tl = interpreter.tl

        langs = tuple(id(value) for value in fn.__globals__.values() if isinstance(value, type(tl)) and value in (tl, tl.core))
        changes = recorded.get(langs)
        if changes is None:
            in_launch = any(_patched(other) for other in recorded.values())
            scope = original(fn)
            if not in_launch:  # recorded from the unpatched module only
                recorded[langs] = [(obj, name, getattr(obj, name)) for obj, name, _ in scope._changes]
            return scope
        scope = scope_class()
        if not _patched(changes):  # inside a launch (a jit helper's call) the patches are in place already
            for obj, name, value in changes:
                scope.set_attr(obj, name, value)
        return scope

    _patch_lang._uakl_recording = True
    _patch_lang._uakl_original = original
    interpreter._patch_lang = _patch_lang
    return True


def _patched(changes) -> bool:
    """Whether ``triton.language`` holds the recorded values now: a call inside a launch, where Triton walks the
    patched module again (the device-function path) and sets wrappers equal to those in place, which it never
    restores."""
    return all(getattr(obj, name, None) is value for obj, name, value in changes)

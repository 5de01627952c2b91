"""The test processes' Triton interpreter without its per-call rebuild of ``triton.language``'s patches.

On a CPU, TRL's fused log-prob kernel (and Liger's kernels) run in Triton's interpreter (TRITON_INTERPRET=1). Before each
kernel launch, and again at every call of a ``@triton.jit`` helper inside a kernel, the interpreter's ``_patch_lang``
walks ``triton.language`` with ``inspect.getmembers`` and builds a fresh wrapper for each of its builtins; the launch
restores them afterwards. Measured over the whole suite (py-spy, 2026-11-29): 126 of the 350 CPU-seconds the
interpreter took went to that walk, not to the kernels. With it gone from the test processes, the suite's CPU time
fell from 1,263 to 954 s (user; one run each on this 2-core machine).

What it sets does not depend on the call: which modules the kernel's globals hold (``triton.language``,
``triton.language.core``) and the interpreter's own module state. So the first launch, on an unpatched
``triton.language``, records every ``(object, name, value)`` the walk sets, and later launches set the same values
again through the same :class:`_LangPatchScope` (its restore is unchanged, and also marks the launch ended); a jit
helper's call inside a launch that patched its modules sets nothing (they are in place). The kernels then run on the
same patched functions and give the same results; only the walk is saved. ``_get_np_dtype``, which builds a 19-entry
dict at every call, becomes a lookup in a table filled from Triton's own answers. This touches no package code and no
library outside the test processes: a GPU never runs the interpreter.

Installed for Triton 3.9 (the suite's) only; on another release the interpreter is left as it is (slower, equal).
"""

SUPPORTED = ("3.9.",)


def install() -> bool:
    """Replace the interpreter's ``_patch_lang`` by the recording one and its ``_get_np_dtype`` by a table lookup; True
    if installed."""
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
    #: The modules (ids of ``triton.language`` and/or ``.core``) whose patches the launch under way put in place.
    launch = {"langs": None}

    class _LaunchScope(scope_class):
        """A launch's scope (GridExecutor restores it when the launch ends, even on an error): its restore also ends the
        launch."""

        def restore(self) -> None:
            try:
                super().restore()
            finally:
                launch["langs"] = None

    def _launch(scope):
        started = _LaunchScope()
        started._changes = scope._changes
        return started

    def _patch_lang(fn):
        tl = interpreter.tl

        langs = tuple(id(value) for value in fn.__globals__.values() if isinstance(value, type(tl)) and value in (tl, tl.core))
        if launch["langs"] is not None and set(langs) <= set(launch["langs"]):
            # a jit helper's call inside a launch that patched its modules already: Triton's walk would set wrappers
            # equal to those in place (and never restore them)
            return scope_class()
        changes = recorded.get(langs)
        if changes is None:
            in_launch = launch["langs"] is not None
            scope = original(fn)
            if in_launch:  # a helper reaching modules the launch did not patch: Triton's own walk, as without this
                return scope
            recorded[langs] = [(obj, name, getattr(obj, name)) for obj, name, _ in scope._changes]
        else:
            scope = scope_class()
            for obj, name, value in changes:
                scope.set_attr(obj, name, value)
        launch["langs"] = langs
        return _launch(scope)

    _patch_lang._uakl_recording = True
    _patch_lang._uakl_original = original
    interpreter._patch_lang = _patch_lang
    interpreter._get_np_dtype = _np_dtype_table(interpreter)
    return True


def _np_dtype_table(interpreter):
    """``_get_np_dtype`` as one lookup: Triton's builds its 19-entry dict (hashing each dtype) at every call, ~10 % of the
    interpreter's time in TRL's kernels. The table holds what Triton's own function answers for every scalar dtype
    ``triton.language`` defines; pointers, blocks and anything not in the table take the same branches as Triton's, and
    a dtype it does not know goes to Triton's function (which raises as before)."""
    tl, original = interpreter.tl, interpreter._get_np_dtype
    table = {}
    for value in vars(tl).values():
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type)):
            try:
                table[value] = original(value)
            except KeyError:
                pass
    pointer = original(tl.pointer_type(tl.float32))

    def _get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            element = tt_dtype.element_ty
            if isinstance(element, tl.pointer_type):
                return pointer
            found = table.get(element)
        else:
            found = table.get(tt_dtype)
        return original(tt_dtype) if found is None else found

    _get_np_dtype._uakl_original = original
    return _get_np_dtype

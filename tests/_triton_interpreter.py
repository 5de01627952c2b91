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
helper's call inside a launch that patched its modules sets nothing (they are in place). A helper that reaches a module
the launch did not patch (``tl.max``, ``tl.sum``: triton.language's own helpers see only ``triton.language.core``) is
walked by Triton at every call, its wrappers never restored; here its first call under a launch's modules records what
the walk set and later calls set the same values again (2026-11-29: 778 walks in one forward and backward of TRL's
kernel; test_trl.py 77 -> 52 user-s). The kernels then run on the same patched functions and give the same results;
only the walk is saved. ``_get_np_dtype``, which builds a 19-entry dict at every call, becomes a lookup in a table
filled from Triton's own answers. This touches no package code and no library outside the test processes: a GPU never
runs the interpreter.

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
    #: (the modules of the launch under way, None for a launch itself; the function's modules) -> what Triton's walk set
    recorded = {}
    walks = [0]  # Triton's own walks so far (each records)
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

    def _walk(fn, key):
        """Triton's own walk, and what it set recorded under ``key``."""
        walks[0] += 1
        scope = original(fn)
        recorded[key] = [(obj, name, getattr(obj, name)) for obj, name, _ in scope._changes]
        return scope

    def _patch_lang(fn):
        tl = interpreter.tl

        langs = tuple(id(value) for value in fn.__globals__.values() if isinstance(value, type(tl)) and value in (tl, tl.core))
        if launch["langs"] is not None:  # a jit helper's call inside a launch (Triton drops the scope it gets back)
            if set(langs) <= set(launch["langs"]):
                # the launch patched its modules already: Triton's walk would set wrappers equal to those in place
                return scope_class()
            # A helper reaching a module the launch did not patch (triton.language's own helpers, tl.max or tl.sum, see
            # only triton.language.core): Triton's walk wraps that module's builtins and never restores them. The first
            # call under this launch's modules records what the walk set; a later one sets the same values again.
            key = (launch["langs"], langs)
            changes = recorded.get(key)
            if changes is None:
                return _walk(fn, key)
            for obj, name, value in changes:
                setattr(obj, name, value)
            return scope_class()
        changes = recorded.get((None, langs))
        if changes is None:
            scope = _walk(fn, (None, langs))
        else:
            scope = scope_class()
            for obj, name, value in changes:
                scope.set_attr(obj, name, value)
        launch["langs"] = langs
        return _launch(scope)

    _patch_lang._uakl_recording = True
    _patch_lang._uakl_original = original
    _patch_lang._uakl_walks = walks
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

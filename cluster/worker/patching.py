"""Reading and rewriting mlx-lm's module code without editing mlx-lm.

The engine serves mlx-lm's own model classes: it reads what a module's `__call__` refers
to (to find the attention, recurrent and SwiGLU modules of any family) and swaps a
module's class, per instance, for a subclass whose `__call__` is the original one seeing
other globals (`rebind`). A swapped class keeps its original call as
`__call__._orchard_original`, so reading it again finds mlx-lm's code.
"""

from __future__ import annotations

import types


def original_call(cls: type) -> types.FunctionType | None:
    """`cls.__call__` as mlx-lm wrote it (through any swap made here), or None."""
    call = getattr(cls, "__call__", None)  # noqa: B004  (the function itself, not whether cls is callable)
    return getattr(call, "_orchard_original", call) if isinstance(call, types.FunctionType) else None


def calls(cls: type, name: str) -> bool:
    """Whether `cls`'s own `__call__` refers to `name` (a global, attribute or method)."""
    call = original_call(cls)
    return call is not None and name in _names(call.__code__)


def _names(code) -> set[str]:
    """Every name a code object (and the functions nested in it) refers to."""
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def rebind(fn: types.FunctionType, **names) -> types.FunctionType:
    """A copy of `fn` that sees `names` in place of its module's globals of those names."""
    g = dict(fn.__globals__)
    g.update(names)
    out = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__qualname__ = fn.__qualname__
    return out

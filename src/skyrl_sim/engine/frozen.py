"""A faster ``__init__`` for the engine's frozen dataclasses made once per request or per call.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__`` (its own ``__setattr__``
refuses), which costs about a quarter of a microsecond a field; a long run makes a ``Request``, a few client actions, a
``CallShape`` and its ``MicroBatch``es per request or call, millions in all. ``quick_init`` gives such a class an
``__init__`` with the same parameters, defaults and default factories that fills the instance's attributes at once
(``__dict__.update``, half the time): the class stays frozen (assignment still raises), and equality, hashing,
``repr`` and ``dataclasses.replace`` are the dataclass's own. An instance whose ``__dict__`` is filled so is a real
dict (twice the bytes of the attributes CPython keeps inline), so a class whose instances are held for long (a
``Request`` waits in the queue) is made ``held``: its fields set one by one through a bound ``object.__setattr__``
(a fifth less time, no more memory). A class made with ``slots=True`` (``@dataclass(frozen=True, slots=True)``) keeps
its fields in slots, no ``__dict__`` at all: its ``__init__`` sets each through the slot's own descriptor (a quarter
of the time of ``object.__setattr__``, and the least memory), so a hot class held or not is best made so.
``tests/test_frozen_init.py`` holds each such class to it.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_FACTORY = object()  # the default of a parameter whose field has a default factory


def quick_init(cls: type[T] | None = None, *, held: bool = False) -> Any:
    """``cls`` (a frozen dataclass, with slots or a ``__dict__``, no ``__post_init__``, no keyword-only fields) with a
    faster ``__init__`` of the same signature; ``@quick_init(held=True)`` for a class with a ``__dict__`` whose
    instances live long (a slotted class is compact either way)."""
    if cls is None:
        return lambda c: _quick_init(c, held)
    return _quick_init(cls, held)


def _quick_init(cls: type[T], held: bool) -> type[T]:
    if not is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} is not a frozen dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: quick_init runs no __post_init__")
    slotted = "__slots__" in cls.__dict__
    namespace: dict[str, Any] = {"_FACTORY": _FACTORY, "_set": object.__setattr__}
    params, factories, names = [], [], []
    for f in fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: quick_init takes positional init fields only")
        names.append(f.name)
        if f.default is not MISSING:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            namespace[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_FACTORY")
            factories.append(f"    if {f.name} is _FACTORY:\n        {f.name} = _factory_{f.name}()\n")
        else:
            params.append(f.name)
    if slotted:  # each slot's member descriptor, called directly (the frozen class's __setattr__ refuses)
        namespace.update({f"_slot_{n}": getattr(cls, n).__set__ for n in names})
        fill = "".join(f"    _slot_{n}(self, {n})\n" for n in names)
    elif held:
        fill = "".join(f"    _set(self, {n!r}, {n})\n" for n in names)
    else:
        fill = f"    self.__dict__.update({', '.join(f'{n}={n}' for n in names)})\n"
    body = "".join(factories) + fill
    exec(f"def __init__(self, {', '.join(params)}):\n{body}", namespace)  # noqa: S102 - built from field names only
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[misc]
    return cls

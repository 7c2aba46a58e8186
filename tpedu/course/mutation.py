"""Lesson 16: a bug as one edit of tpedu's own source, so the code that ran can be shown as it ran.

A `Mutation` names a function or method of tpedu (its owner, a module or a class, and the
attribute), a piece of its source and what that piece becomes. `function()` compiles the edited
source in the owner's module, so the broken version reads and runs exactly like tpedu's with the
one edit (same name, same globals, same file and line numbers); `patch()` puts it in place for a
block; `diff()` is the edit as a unified diff.

    edit = Mutation(schedules, "one_f_one_b", "min(n_stages - 1 - stage, n_micro)",
                    "min(stage, n_micro)")
    with edit.patch():             # tpedu's 1F1B counts its warm-up from the wrong end
        ...

`Suspect` is any function that runs on a path, broken or not: its source (the edited one when a
mutation is given) and the names it reads from its module, for a reader who rewrites it.
`install(fn)` puts a rewrite in its place, everywhere tpedu refers to it, and reports whether
the rewrite itself ever ran tpedu's own function (which, under a mutation, runs broken).

Both work on the function object itself, not only on the name: a mutation swaps the function's
code, so every reference to it (an alias imported elsewhere, a wrapper that calls it) runs the
edited code, as an edit of the file would make it.
"""

from __future__ import annotations
import __future__

import contextlib
import difflib
import inspect
import itertools
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FunctionType, ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the directory above tpedu/: paths print from here
FLAGS = __future__.annotations.compiler_flag  # tpedu's modules defer their annotations


@contextlib.contextmanager
def patched(owner: object, attr: str, value: object) -> Iterator[None]:
    """Set owner.attr = value for the block (class attributes keep their staticmethod wrapper;
    one the class only inherits is deleted again afterwards)."""
    inherited = isinstance(owner, type) and attr not in owner.__dict__
    old = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if inherited:
            delattr(owner, attr)
        else:
            setattr(owner, attr, old)


def _raw(owner: object, attr: str) -> tuple[FunctionType, type | None]:
    """The plain function behind owner.attr and its wrapper (staticmethod, classmethod or None)."""
    value = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__, type(value)
    if not isinstance(value, FunctionType):
        raise TypeError(f"{attr} is a {type(value).__name__}, not a function")
    return value, None


def _module_of(owner: object) -> ModuleType:
    return owner if isinstance(owner, ModuleType) else inspect.getmodule(owner)


@contextlib.contextmanager
def swapped_code(
    fn: FunctionType, code: CodeType, defaults: tuple | None, kwdefaults: dict | None
) -> Iterator[None]:
    """Run `code` (with these defaults) whenever the function object `fn` is called, for the
    block: every reference to `fn` (its module's name, an alias, a closure) runs it."""
    if len(code.co_freevars) != len(fn.__closure__ or ()):
        raise ValueError(f"{fn.__name__}: the new code needs {code.co_freevars}, not a closure")
    old = fn.__code__, fn.__defaults__, fn.__kwdefaults__
    # Defaults first: CPython binds them against the code's parameters at each call.
    fn.__defaults__, fn.__kwdefaults__ = None, None
    fn.__code__ = code
    fn.__defaults__, fn.__kwdefaults__ = defaults, kwdefaults
    try:
        yield
    finally:
        fn.__defaults__, fn.__kwdefaults__ = None, None
        fn.__code__ = old[0]
        fn.__defaults__, fn.__kwdefaults__ = old[1], old[2]


@dataclass
class Reached:
    """How often tpedu's own function ran (through any reference) while a rewrite was in place."""

    calls: int = 0
    impl: Callable | None = field(default=None, repr=False)  # what it runs meanwhile


_TRIPS: dict[int, Reached] = {}
_KEYS = itertools.count()


def _trip(key: int, args: tuple, kwargs: dict) -> object:
    """What tpedu's own function runs while a rewrite is installed: count, then run as before."""
    reached = _TRIPS[key]
    reached.calls += 1
    return reached.impl(*args, **kwargs)


def _tripwire(name: str, key: int) -> CodeType:
    """The code of a function `name(*args, **kwargs)` that calls _trip(key, args, kwargs). It
    reads no globals (the builtin __import__ only), so it runs in any function's module."""
    src = (
        f"def {name}(*args, **kwargs):\n"
        f"    return __import__('tpedu.course.mutation', fromlist=['_trip'])._trip({key}, args, "
        "kwargs)\n"
    )
    module = compile(src, f"<tpedu's own {name}>", "exec")
    return next(c for c in module.co_consts if isinstance(c, CodeType))


def tpedu_aliases(fn: FunctionType) -> list[tuple[ModuleType, str]]:
    """(module, name) for every tpedu module that holds `fn` under a name of its own (imported
    with `from ... import`), besides the one that defines it."""
    out = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "tpedu" or mod_name.startswith("tpedu.")):
            continue
        out += [(mod, n) for n, v in list(vars(mod).items()) if v is fn]
    return out


@dataclass(frozen=True)
class Suspect:
    """A function on a failing path: `owner.attr`, shown under `name` (e.g. "Layout.rank")."""

    owner: object  # a module or a class
    attr: str

    @property
    def name(self) -> str:
        return (
            self.attr
            if isinstance(self.owner, ModuleType)
            else f"{self.owner.__name__}.{self.attr}"
        )

    @property
    def original(self) -> FunctionType:
        """tpedu's own function (unwrapped from staticmethod / classmethod)."""
        return _raw(self.owner, self.attr)[0]

    @property
    def wrapper(self) -> type | None:
        return _raw(self.owner, self.attr)[1]

    def where(self) -> tuple[str, int]:
        """(its file, relative to the repository, its first line)."""
        fn = self.original
        path = Path(inspect.getsourcefile(fn)).resolve()
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        return shown.as_posix(), fn.__code__.co_firstlineno

    def source(self) -> str:
        """tpedu's source of it, dedented (a method: as it reads inside its class)."""
        return textwrap.dedent(inspect.getsource(self.original))

    @contextlib.contextmanager
    def install(self, fn: Callable) -> Iterator[Reached]:
        """A block in which tpedu runs `fn` in place of this function: owner.attr (wrapped as the
        original is) and every tpedu module's alias of it. tpedu's own function object keeps
        running what it ran before (the broken code, under a mutation), and the `Reached` it
        yields counts its calls: nothing in tpedu calls it any more, so a call came from `fn`
        (a wrapper, an alias, a captured reference)."""
        original, wrap = self.original, self.wrapper
        reached = Reached()
        reached.impl = FunctionType(
            original.__code__,
            original.__globals__,
            original.__name__,
            original.__defaults__,
            original.__closure__,
        )
        reached.impl.__kwdefaults__ = original.__kwdefaults__
        key = next(_KEYS)
        _TRIPS[key] = reached
        with contextlib.ExitStack() as stack:
            stack.callback(_TRIPS.pop, key)
            for module, name in tpedu_aliases(original):
                if (module, name) != (self.owner, self.attr):
                    stack.enter_context(patched(module, name, fn))
            stack.enter_context(patched(self.owner, self.attr, wrap(fn) if wrap else fn))
            stack.enter_context(
                swapped_code(original, _tripwire(original.__name__, key), None, None)
            )
            yield reached


def globals_read(code: object, namespace: dict) -> list[str]:
    """The names a code object (and the functions, lambdas and comprehensions inside it) reads
    from `namespace`, in first-use order; builtins not counted."""
    names: list[str] = []
    stack = [code]
    while stack:
        c = stack.pop()
        names += [n for n in c.co_names if n in namespace and n not in names]
        stack += [k for k in c.co_consts if hasattr(k, "co_names")]
    return names


@dataclass(frozen=True)
class Mutation:
    """One edit of one tpedu function: `old` (a piece of its dedented source, found exactly
    once) becomes `new`."""

    owner: object
    attr: str
    old: str
    new: str

    @property
    def suspect(self) -> Suspect:
        return Suspect(self.owner, self.attr)

    def source(self) -> str:
        """The function's dedented source with the edit made (raises if `old` is not there
        exactly once: tpedu's code changed under the bug)."""
        text = self.suspect.source()
        if text.count(self.old) != 1:
            raise ValueError(
                f"{self.suspect.name}: the text to edit occurs {text.count(self.old)} times in its "
                f"source, not once: {self.old!r}"
            )
        return text.replace(self.old, self.new)

    def function(self) -> FunctionType:
        """The edited function, compiled in the owner's module (its globals, its file name, its
        line numbers), unwrapped."""
        original = self.suspect.original
        module = _module_of(self.owner)
        pad = "\n" * (original.__code__.co_firstlineno - 1)  # line numbers as in the file
        code = compile(pad + self.source(), original.__code__.co_filename, "exec", FLAGS, True)
        scope: dict = {}
        exec(code, module.__dict__, scope)
        fn = scope[original.__name__]
        return fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn

    def patch(self) -> contextlib.AbstractContextManager:
        """A block that runs tpedu with the edit in place: tpedu's function object runs the
        edited code, wherever it is referred to from."""
        fn = self.function()
        return swapped_code(self.suspect.original, fn.__code__, fn.__defaults__, fn.__kwdefaults__)

    def diff(self) -> str:
        """The edit as a unified diff: tpedu's lines, then the lines that ran."""
        path, first = self.suspect.where()
        before, after = self.suspect.source(), self.source()
        lines = difflib.unified_diff(
            before.splitlines(),
            after.splitlines(),
            f"{path} (tpedu)",
            f"{path} (as it ran)",
            n=2,
            lineterm="",
        )
        out = []
        for line in lines:
            if line.startswith("@@"):  # hunk headers count from the function: make them file lines
                a, b = line.split()[1:3]
                a0, b0 = (int(x[1:].split(",")[0]) + first - 1 for x in (a, b))
                line = f"@@ -{a0} +{b0} @@"
            out.append(line)
        return "\n".join(out)

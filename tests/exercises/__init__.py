"""Helpers the exercises' tests share: a group smaller than the world, and tpedu's own code
refused while the learner's runs."""

import contextlib
from collections.abc import Callable, Iterator
from types import CodeType, FunctionType, MethodType

import torch.distributed as dist

from tpedu.course.mutation import swapped_code


def parity_group() -> tuple[dist.ProcessGroup, list[int]]:
    """On 4 ranks: groups {0, 2} and {1, 3}; returns this rank's group and its members.

    Every rank creates both groups, in the same order (new_group is collective over the world).
    An exercise that ignores its group argument and reduces over all 4 ranks gets wrong values.
    """
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    k = dist.get_rank() % 2
    return groups[k], [k, k + 2]


def refused(fn: Callable) -> str:
    """The message a refused tpedu function raises: it names itself."""
    fn = _function(fn)
    return (
        f"tpedu's own {fn.__module__}.{fn.__qualname__} ran: a wrapper or an alias of it is "
        "not your code; write it yourself"
    )


def _function(fn: Callable) -> FunctionType:
    """The plain function behind `fn` (a classmethod, bound to its class, unwrapped)."""
    fn = fn.__func__ if isinstance(fn, (MethodType, staticmethod, classmethod)) else fn
    if not isinstance(fn, FunctionType):
        raise TypeError(f"{fn!r} is not a Python function: its code cannot be swapped")
    return fn


def _refusal(fn: FunctionType) -> CodeType:
    """Code for `fn`'s function object that raises refused(fn). It reads no globals (it runs
    with `fn`'s) and keeps `fn`'s free variables (a method that calls super() has __class__),
    so it fits the function's closure."""
    free = fn.__code__.co_freevars
    src = "def _outer():\n"
    src += "".join(f"    {v} = None\n" for v in free)
    src += f"    def {fn.__name__}(*args, **kwargs):\n"
    src += f"        ({', '.join(free)},)\n" if free else ""
    src += f"        raise RuntimeError({refused(fn)!r})\n"
    src += f"    return {fn.__name__}\n"
    outer = next(c for c in compile(src, "<refused>", "exec").co_consts if isinstance(c, CodeType))
    code = next(c for c in outer.co_consts if isinstance(c, CodeType))
    assert code.co_freevars == free, (code.co_freevars, free)
    return code


@contextlib.contextmanager
def refusing(*twins: Callable) -> Iterator[None]:
    """For the block, each of tpedu's own functions `twins` (methods too: Function.forward)
    raises RuntimeError(refused(twin)) however it is reached: by its module's name, an alias,
    a wrapper, a subclass. Around the learner's code, so that an exercise is passed only by
    code the learner wrote, not by calling tpedu's twin of it. Also a decorator; in forked
    ranks as well (they inherit the swapped code). Expected values are computed outside it."""
    with contextlib.ExitStack() as stack:
        for fn in twins:
            fn = _function(fn)
            stack.enter_context(swapped_code(fn, _refusal(fn), None, None))
        yield

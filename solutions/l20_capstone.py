"""Reference for exercises/l20_capstone.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tpedu.course.capstone import MB, Budget, Candidate, describe, measure
from tpedu.model.config import GPTConfig
from tpedu.parallel.config import ParallelConfig


def survey(config: GPTConfig, budget: Budget) -> list[Candidate]:
    """Every layout of the space, in its order, measured by the dry run; the ones this model
    cannot run at all are left out. No ranking: which one to run is `choose`'s question."""
    n = budget.ranks
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s <= n]
    found = []
    for tp in sizes:
        for pp in sizes:
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                for sp in (False, True) if tp > 1 else (False,):
                    parallel = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, sequence_parallel=sp)
                    try:
                        found.append(measure(config, parallel, budget))
                    except ValueError:  # tp not dividing the heads, more stages than layers
                        continue
    return found


def choose(
    found: Sequence[Candidate], seconds: Mapping[str, float], budget: Budget
) -> tuple[ParallelConfig, str]:
    """The layout within the budget with the most memory headroom (ties: the fewer bytes on
    the wire), and why: the layout first, then its figures, then what it costs against the
    others (bytes on the wire, measured time).

    Headroom first because the dry run counts tensors, and a real device holds more: the
    allocator's fragmentation, the communication library's buffers, the runtime's context, a
    larger batch later. A layout at 97 % of the memory is one surprise from
    out-of-memory; a slower step is only slower.
    """
    fitting = [c for c in found if c.fits(budget)]
    if not fitting:
        raise ValueError(
            f"no layout of the {len(found)} measured fits {budget.bytes_per_rank / MB:g} MB "
            f"and {budget.sent_per_rank / MB:g} MB on the wire per rank: a larger budget, or other "
            "memory savers (recompute)"
        )
    best = min(fitting, key=lambda c: (c.peak, c.sent))
    name = describe(best.parallel)
    why = [
        f"{name}: fullest rank {best.peak / MB:.2f} MB of {budget.bytes_per_rank / MB:g} MB, "
        f"{100 * (1 - best.peak / budget.bytes_per_rank):.0f}% headroom, the most of the "
        f"{len(fitting)} layouts within the budget; {best.sent / MB:.2f} MB on the wire per "
        f"step (bound {budget.sent_per_rank / MB:g} MB)."
    ]
    least = min(fitting, key=lambda c: c.sent)
    if least is not best:
        why.append(
            f"It puts {best.sent / least.sent:.1f}x the bytes on the wire of "
            f"{describe(least.parallel)} ({least.sent / MB:.2f} MB)."
        )
    timed = {k: v for k, v in seconds.items() if k in {describe(c.parallel) for c in fitting}}
    if name in timed:
        fastest = min(timed, key=timed.get)
        why.append(
            f"Measured here: {1e3 * timed[name]:.0f} ms per step"
            + (
                f", against {1e3 * timed[fastest]:.0f} ms for the fastest ({fastest}): "
                "the price of the headroom."
                if fastest != name
                else ", the fastest of the layouts timed too."
            )
        )
    return best.parallel, " ".join(why)

"""Grades exercises/l11_one_f_one_b.py: the 1F1B order, its invariants, and a real pipeline run.

The schedule is a list of labels, so it is compared exactly. The real run is float64 and only
reorders sums (micro-batch losses added up), so gradients match the dense model within 1e-10
relative; a wrong order either deadlocks (caught by the launcher's timeout) or still computes
the same gradients, which is why the order itself is checked first. tpedu's own schedules
(tpedu.parallel.pipeline.schedules) refuse to run while the learner's does, so a wrapper or an
alias of them fails.
"""

import pytest
import torch

import tpedu
from tests.exercises import refusing
from tpedu.course.grading import implementation
from tpedu.parallel.pipeline import schedules
from tpedu.parallel.pipeline.schedules import (
    bubble_formula,
    bubble_fraction,
    peak_in_flight,
    simulate,
)

NAME = "l11_one_f_one_b"
TWINS = (schedules.one_f_one_b, schedules.interleaved)


@refusing(*TWINS)
def test_matches_the_worked_example():
    got = implementation(NAME).one_f_one_b(6, 4, 1)
    want = [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("F", 3),
        ("B", 1),
        ("F", 4),
        ("B", 2),
        ("F", 5),
        ("B", 3),
        ("B", 4),
        ("B", 5),
    ]
    assert [tuple(a) for a in got] == want


@refusing(*TWINS)
def test_last_stage_alternates_and_first_stage_warms_up():
    f = implementation(NAME).one_f_one_b
    assert [tuple(a) for a in f(3, 3, 2)] == [
        ("F", 0),
        ("B", 0),
        ("F", 1),
        ("B", 1),
        ("F", 2),
        ("B", 2),
    ]
    assert [tuple(a) for a in f(5, 3, 0)][:3] == [("F", 0), ("F", 1), ("F", 2)]
    # fewer micro-batches than stages: the warm-up is cut to m, then all backwards
    assert [tuple(a) for a in f(2, 5, 0)] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize(("m", "p"), [(1, 1), (5, 2), (7, 3), (4, 4), (9, 4), (3, 5)])
@refusing(*TWINS)
def test_invariants_bound_and_bubble(m, p):
    f = implementation(NAME).one_f_one_b
    scheds = [[tuple(a) for a in f(m, p, s)] for s in range(p)]
    for s, acts in enumerate(scheds):
        assert sorted(acts) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(acts.index(("F", i)) < acts.index(("B", i)) for i in range(m)), "B before F"
        assert [a[1] for a in acts if a[0] == "B"] == list(range(m)), "backwards out of order"
        assert peak_in_flight(acts) == min(m, p - s), f"stage {s}: too many activations held"
    # on the ideal clock (F = B = 1): no deadlock and exactly the bubble (p-1)/(m+p-1)
    assert bubble_fraction(simulate(scheds)) == pytest.approx(bubble_formula(m, p), abs=1e-12)


def test_runs_a_real_pipeline_with_dense_gradients():
    from tpedu.model.config import GPTConfig
    from tpedu.model.dense import DenseGPT
    from tpedu.parallel.mesh import Layout, Mesh
    from tpedu.parallel.pipeline.runtime import (
        Pipe,
        build_stage_chunks,
        run_schedule,
        sync_tied_grads,
    )

    config = GPTConfig.gpt2_like(23, seq_len=6, n_layers=3, hidden=8, n_heads=2)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 23, (6, 5), generator=g)
    tgt = torch.randint(0, 23, (6, 5), generator=g)

    def worker():
        mesh = Mesh(Layout(1, 3, 1))
        torch.manual_seed(0)  # built on the CPU (the same init on every rank), then moved
        chunks = [
            c.double().to(tpedu.device())
            for c in build_stage_chunks(DenseGPT(config), mesh.tp_group, mesh.pp_rank, 3)
        ]
        x, y = ids.to(tpedu.device()), tgt.to(tpedu.device())
        with refusing(*TWINS):
            acts = implementation(NAME).one_f_one_b(3, 3, mesh.pp_rank)
        run_schedule(
            chunks,
            acts,
            Pipe.from_mesh(mesh),
            list(x.chunk(3)),
            list(y.chunk(3)),
            (2, 5, 8),
            torch.float64,
        )
        sync_tied_grads(chunks, mesh.emb_group)
        return chunks[0].gather_state_dict(grads=True)

    torch.manual_seed(0)
    dense = DenseGPT(config).double()
    dense(ids, tgt).backward()
    grads = {}
    for part in tpedu.launch(worker, 3, timeout=30):
        grads.update(part)
    for name, p in dense.named_parameters():
        diff = (grads[name] - p.grad).abs().max().item()
        assert diff <= 1e-10 * p.grad.abs().max().item(), (
            f"{name}: max |pipeline - dense| = {diff:.2e}"
        )

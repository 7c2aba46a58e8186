"""Lesson 18: mixtures of experts and expert parallelism: a router sends each token to k of E
expert MLPs; expert parallelism puts the experts on different ranks and moves the tokens.

    router           top-k gate, capacity and GShard's drop priority, load-balancing and z-losses
    dense            DenseMoE: every expert on one process, the reference (and MoEOutput)
    dispatch         the variable-size all-to-alls (and the statistics' all-reduce) as autograd
                     Functions
    expert_parallel  ExpertParallelMoE: experts split over the EP ranks, tokens all-to-all'ed
                     to them and back; which gradients are reduced over which group

Tested against DenseMoE in float64 at ep 1, 2, 4 (tests/test_moe.py).
"""

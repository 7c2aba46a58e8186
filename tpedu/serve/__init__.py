"""Lesson 17: serving a tensor-parallel GPT with a KV cache sharded by heads
(tpedu.tp.kv_cache: each rank's K and V of its own KV heads, per layer, for a batch).

    generate  prefill, one-token decode steps, and batched generation (greedy or sampled,
              per-sequence stop tokens and lengths) through the vocab-parallel sampler

Per decoded token a TP model runs 2 all-reduces of b·H per layer (attention out-projection,
MLP fc2), 1 for a vocab-parallel embedding, and the sampler's 2 small all-gathers (b·t).
"""

"""Lesson 09: context parallelism: the sequence split across ranks for the whole layer.

    ring     ring attention: K/V blocks passed around the CP ranks, merged by log-sum-exp;
             contiguous and zig-zag position assignments
    ulysses  Ulysses attention: all-to-all from sequence shards to head shards and back
    balance  causal work per rank (useful pairs, blocks computed), contiguous vs zig-zag
    traffic  ring and Ulysses messages and bytes per step, their α-β time, timers
    gradients  the gradients' sum over the CP ranks (a model alone; training folds it into DP's)

The model takes either attention through ParallelConfig's cp, cp_strategy ("ring" or "ulysses")
and cp_layout ("zigzag" or "contiguous").
"""

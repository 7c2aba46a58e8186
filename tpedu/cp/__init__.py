"""Lesson 09: context parallelism: the sequence split across ranks for the whole layer.

    ring     ring attention: K/V blocks passed around the CP ranks, merged by log-sum-exp;
             contiguous and zig-zag position assignments
    ulysses  Ulysses attention: all-to-all from sequence shards to head shards and back
    balance  causal work per rank (useful pairs, blocks computed), contiguous vs zig-zag
    traffic  ring and Ulysses messages and bytes per step, their α-β time, timers
    gradients  the gradients' sum over the CP ranks (a model alone; training folds it into DP's)
    context  ContextParallel: the group, strategy and layout as one object the model asks

A model runs CP through `RunOptions(context=ContextParallel(group, strategy, layout))`, which
ParallelConfig's cp, cp_strategy ("ring" or "ulysses") and cp_layout ("zigzag" or "contiguous")
build for a training run.
"""

"""Lesson 09: context parallelism: the sequence split across ranks for the whole layer.

ring   ring attention: K/V blocks passed around the CP ranks, merged by log-sum-exp;
       contiguous and zig-zag position assignments
balance  lesson 09: causal work per rank (useful pairs, blocks computed), contiguous vs zig-zag
traffic  lesson 09: ring and Ulysses messages and bytes per step, their α-β time, timers
"""

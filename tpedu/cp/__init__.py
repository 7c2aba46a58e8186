"""Lessons 08–09: context parallelism: the sequence split across ranks for the whole layer.

ring   ring attention: K/V blocks passed around the CP ranks, merged by log-sum-exp;
       contiguous and zig-zag position assignments
"""

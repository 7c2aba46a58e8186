"""Reference for exercises/l05_qkv_split.py."""

# the reference lives in tpedu/tp/attention.py
from tpedu.tp.attention import local_heads, split_qkv

__all__ = ["local_heads", "split_qkv"]

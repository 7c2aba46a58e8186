"""Reference for exercises/l12_groups.py."""

from tpedu.mesh import rank_groups  # the reference lives in tpedu/mesh.py

__all__ = ["rank_groups"]

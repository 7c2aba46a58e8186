import torch.distributed as dist


def parity_group() -> tuple[dist.ProcessGroup, list[int]]:
    """On 4 ranks: groups {0, 2} and {1, 3}; returns this rank's group and its members.

    Every rank creates both groups, in the same order (new_group is collective over the world).
    An exercise that ignores its group argument and reduces over all 4 ranks gets wrong values.
    """
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    k = dist.get_rank() % 2
    return groups[k], [k, k + 2]

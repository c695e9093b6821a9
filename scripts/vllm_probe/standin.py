"""Stand-in vLLM parallel groups: one engine rank's layout in this process, with no torch.distributed.

vLLM layers read tp/pp/dp/ep sizes and ranks from vllm.distributed.parallel_state's module globals
(_WORLD, _TP, _PP, _DP, _EP, _DCP, _PCP, _ETP) while they are built (and parameters stamp tp_rank
then). Fill those globals with GroupCoordinator objects that hold only ranks, laid out exactly as
initialize_model_parallel lays them out (ExternalDP x DP x PP x PCP x TP).
"""
import contextlib
import torch
import vllm.distributed.parallel_state as ps

_GLOBALS = ("_WORLD", "_TP", "_ETP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB", "_ENGRAM_DP", "_INNER_DP_WORLD", "_NODE_COUNT")


class StandInProcessGroup:
    """What model code asks a torch ProcessGroup while building (qwen3_moe: ep_group.size())."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _standin(name, group_ranks, rank):
    g = object.__new__(ps.GroupCoordinator)
    (ranks,) = [r for r in group_ranks if rank in r]
    g.unique_name = f"standin_{name}"
    g.rank, g.ranks, g.world_size, g.rank_in_group = rank, ranks, len(ranks), ranks.index(rank)
    g.local_rank = g.device_index = rank
    g.group_ranks = group_ranks
    g.cpu_group = g.device_group = StandInProcessGroup(g.world_size, g.rank_in_group)
    g.device = torch.device("cpu")
    g.use_device_communicator = False
    g.device_communicator = None
    g.mq_broadcaster = None
    g.use_custom_op_call = False
    g.torch_distributed_backend = "gloo"
    return g


def group_ranks(tp, pp=1, dp=1, pcp=1, dcp=1, is_moe=True):
    world = dp * pp * pcp * tp
    a = torch.arange(world).reshape(-1, dp, pp, pcp, tp)
    lists = lambda t, n: [x.tolist() for x in t.reshape(-1, n).unbind(0)]
    out = {
        "world": [list(range(world))],
        "tp": lists(a.view(-1, tp), tp),
        "dcp": lists(a.transpose(-1, -2) if dcp > 1 else a, dcp),
        "pcp": lists(a.transpose(3, 4), pcp),
        "pp": lists(a.transpose(2, 4), pp),
        "dp": lists(a.transpose(1, 4), dp),
    }
    if is_moe:
        out["ep"] = lists(a.transpose(1, 2), dp * pcp * tp)
    return out


@contextlib.contextmanager
def engine_rank(rank, **sizes):
    """Make parallel_state report engine rank ``rank`` (world rank across DP) of a layout."""
    saved = {k: getattr(ps, k) for k in _GLOBALS}
    try:
        groups = {k: _standin(k, v, rank) for k, v in group_ranks(**sizes).items()}
        ps._WORLD, ps._TP, ps._DCP, ps._PCP, ps._PP, ps._DP = (groups[k] for k in ("world", "tp", "dcp", "pcp", "pp", "dp"))
        ps._ETP = ps._TP
        ps._INNER_DP_WORLD = ps._WORLD
        ps._EP = groups.get("ep")
        ps._EPLB = None
        ps._NODE_COUNT = 1
        yield groups
    finally:
        for k, v in saved.items():
            setattr(ps, k, v)

"""pyzero: ring collectives, DDP-style data parallel, ZeRO and tensor parallelism
for PyTorch, over a torch-free C++/CUDA core (``pyzero._C``)."""
from . import _C
from .comm import (
    CollectiveError,
    CollectiveTimeout,
    Group,
    Options,
    Work,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    comm_stats,
    destroy,
    get_backend,
    get_local_rank,
    get_rank,
    get_world_size,
    init,
    is_initialized,
    new_group,
    recv,
    reduce_scatter,
    send,
)

from . import checkpoint, zero
from .zero import ZeroOptimizer
from .flight import dump as debug_dump

build_info = _C.build_info

__version__ = "0.1.0"
from . import symmetric, tp
from .mesh import mesh
from . import pipeline
from .parallel import DataParallel
from .plan import parallelize, plan  # noqa: E402  (pz.plan is the function; the package is pyzero.plan)

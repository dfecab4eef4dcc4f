"""pyzero: ring collectives, DDP-style data parallel, ZeRO and tensor parallelism
for PyTorch, over a torch-free C++/CUDA core (``pyzero._C``)."""
from . import _loader

_C = _loader.import_extension()  # and opens the NCCL library a CUDA build calls (see _loader)
from .comm import (
    CollectiveError,
    CollectiveTimeout,
    Group,
    MessageMismatch,
    Options,
    P2POp,
    Work,
    all_gather,
    all_reduce,
    barrier,
    batch_isend_irecv,
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
    topology,  # noqa: F811  (pz.topology() is the function; the module is pyzero.topology)
)

from . import checkpoint, optim, zero
from .zero import ZeroOptimizer, estimate_memory
from .flight import dump as debug_dump

build_info = _C.build_info
nccl_library = _loader.nccl_library

__version__ = "0.1.0"
from . import symmetric, tp
from .mesh import mesh
from . import pipeline
from .parallel import DataParallel
from .plan import parallelize, plan  # noqa: E402  (pz.plan is the function; the package is pyzero.plan)
from . import ps  # noqa: E402,F401  (pz.ps: parameter-server training)
from torch.distributed import is_available as _torch_distributed_available

if _torch_distributed_available():  # torch builds without it have no process groups to back
    from . import distributed
    distributed.register()  # the torch.distributed backend "pyzero" (no process-group work until torch makes one)

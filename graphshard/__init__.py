"""graphshard: fully sharded data parallel training, done by the compiler.

    model = graphshard.shard(model)
    model = torch.compile(model, backend="graphshard")
"""

from graphshard._torch_version import MIN_TORCH, check_torch_version

check_torch_version()  # first: on a too-old torch, one clear ImportError naming the version

from graphshard import _source_tree  # noqa: F401  (mounts graphshard.passes in a checkout)
from graphshard.api.block_regions import BlockInlinedWarning
from graphshard.api.clip_grad import clip_grad_norm_
from graphshard.api.eager_roots import EagerForwardWarning
from graphshard.api.forward_methods import register_forward_method
from graphshard.api.grad_sync import no_sync, set_requires_all_reduce, set_requires_gradient_sync
from graphshard.api.held_gathers import Unsharded, unshard
from graphshard.api.mixed_precision import MixedPrecision
from graphshard.api.offload import CPUOffload
from graphshard.api.sharding import shard
from graphshard.compiler.backend import GraphshardBackend, backend
from graphshard.compiler.graph_breaks import GraphBreakWarning
from graphshard.compiler.wrapper_choice import PythonWrapperWarning
from graphshard.errors import GraphshardError
from graphshard.safety.failures import RankFailureError, report_rank_failures
from graphshard.safety.fingerprint import PlanMismatchError
from graphshard.safety.guards import ShardedModelError
from graphshard.state.checkpoint import (
    CheckpointInfo,
    CheckpointMismatchError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from graphshard.state.hf import init_non_persistent_buffers, load_safetensors
from graphshard.state.loading import load_full_checkpoint

__all__ = [
    "shard",
    "register_forward_method",
    "backend",
    "GraphshardBackend",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "load_full_checkpoint",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "GraphshardError",
    "report_rank_failures",
    "RankFailureError",
    "PlanMismatchError",
    "ShardedModelError",
    "GraphBreakWarning",
    "BlockInlinedWarning",
    "EagerForwardWarning",
    "PythonWrapperWarning",
    "MixedPrecision",
    "load_safetensors",
    "init_non_persistent_buffers",
    "CPUOffload",
    "no_sync",
    "set_requires_gradient_sync",
    "set_requires_all_reduce",
    "clip_grad_norm_",
    "unshard",
    "Unsharded",
    "MIN_TORCH",
]
__version__ = "0.1.0"

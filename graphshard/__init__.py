"""graphshard: fully sharded data parallel training, done by the compiler.

    model = graphshard.shard(model)
    model = torch.compile(model, backend="graphshard")
"""

from graphshard.compiler import GraphshardBackend, backend
from graphshard.sharding import shard
from graphshard.state_dict import full_state_dict

__all__ = ["shard", "backend", "GraphshardBackend", "full_state_dict"]
__version__ = "0.1.0"

"""SGLang rollout engines: server processes, HTTP generation, weight updates.

Importing this package does not import SGLang (it is needed only inside the server
processes, and by the colocated tensor path for its bucket class); see docs/sglang.md.
"""

from megarl.rollout_sglang.client import SGLangClient, SGLangHTTPError, SGLangUnreachable
from megarl.rollout_sglang.engine import (
    EngineBusy,
    SGLangEngine,
    WeightVersionMismatch,
    generate_across,
    start_engines,
)
from megarl.rollout_sglang.server import (
    ServerLaunchError,
    ServerSpec,
    SGLangServer,
    build_launch_command,
    pick_free_port,
    spec_from_config,
)
from megarl.rollout_sglang.transports import (
    PayloadGather,
    SGLangDiskSync,
    SGLangDistributedSync,
    SGLangTensorSync,
    StageRole,
)

__all__ = [
    "EngineBusy",
    "PayloadGather",
    "SGLangClient",
    "SGLangDiskSync",
    "SGLangDistributedSync",
    "SGLangEngine",
    "SGLangHTTPError",
    "SGLangServer",
    "SGLangTensorSync",
    "SGLangUnreachable",
    "ServerLaunchError",
    "ServerSpec",
    "StageRole",
    "WeightVersionMismatch",
    "build_launch_command",
    "generate_across",
    "pick_free_port",
    "spec_from_config",
    "start_engines",
]

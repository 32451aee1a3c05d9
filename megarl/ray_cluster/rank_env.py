"""What a worker group tells each rank through its environment, beside torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, ...): names only, so that code running in the ranks reads them
without importing Ray; and the one NCCL setting the ranks share with the SGLang servers."""

from __future__ import annotations

import os
from collections.abc import Mapping

# The path of the rank's log file (logs/<role>_rank<N>.log); megarl/weight_sync/progress.py
# writes the rank's place in a push beside it.
RANK_LOG_ENV = "MEGARL_RANK_LOG"

# NCCL's cuMem-backed buffers. SGLang 0.5.23 sets NCCL_CUMEM_ENABLE=0 in its server process
# unless it is already set (sglang/srt/entrypoints/engine.py, _set_envs_and_config), and the
# policy ranks would keep NCCL's own default (on): the two ends of the weight-update group would
# disagree where one NCCL group joins them (the distributed transport): NCCL's P2P between two
# processes needs both to use one kind of buffer (not yet seen on GPUs here). So both sides get
# one explicit value there: the user's, where `megarl launch` runs, else 0 (SGLang's); other
# groups and transports keep NCCL's default (NVLink SHARP needs cuMem).
NCCL_CUMEM_ENV = "NCCL_CUMEM_ENABLE"
NCCL_CUMEM_DEFAULT = "0"


def nccl_cumem_enable(environ: Mapping[str, str] | None = None) -> str:
    """The run's NCCL_CUMEM_ENABLE: the user's (``environ``, default this process's environment)
    or 0. The controller reads it for the policy ranks (megarl/trainer/build.py, with the
    distributed transport) and the servers (ServerSpec.nccl_cumem_enable)."""
    return (os.environ if environ is None else environ).get(NCCL_CUMEM_ENV, NCCL_CUMEM_DEFAULT)

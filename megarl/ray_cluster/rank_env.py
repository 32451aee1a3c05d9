"""What a worker group tells each rank through its environment, beside torchrun's variables
(RANK, WORLD_SIZE, MASTER_ADDR, ...): names only, so that code running in the ranks reads them
without importing Ray."""

from __future__ import annotations

# The path of the rank's log file (logs/<role>_rank<N>.log); megarl/weight_sync/progress.py
# writes the rank's place in a push beside it.
RANK_LOG_ENV = "MEGARL_RANK_LOG"

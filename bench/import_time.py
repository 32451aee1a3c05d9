"""What a process that trains pays before its first step: importing megatron-core, and building a
policy rank on the demo model (gloo, one process), with megatron-core's import-time
``torch.compile`` made lazy (megarl/lazy_compile.py, the default) and as megatron-core has it.

Each case runs in fresh processes, the two sides alternating (lazy, eager, lazy, ...); medians and
the median of the pairs' ratios. Writes bench/results/import_time.json and import_time.md.

    OMP_NUM_THREADS=1 .venv/bin/python bench/import_time.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import describe  # (bench/machine.py)

ROOT = Path(__file__).resolve().parents[1]
# The eager side takes megarl's finder off sys.meta_path before megatron-core is imported.
EAGER = "import sys\nsys.meta_path[:] = [f for f in sys.meta_path if type(f).__module__ != 'megarl.lazy_compile']\n"
IMPORT = "import time\nt = time.perf_counter()\nimport megarl\n{eager}import megatron.core\nprint(time.perf_counter() - t)\n"
BUILD = """import os, time
t = time.perf_counter()
import megarl
{eager}from pathlib import Path
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
from megarl.commands.demo import prepare_demo
from megarl.config.loading import load_config
model, data = prepare_demo(Path("{root}"))
cfg = load_config(Path("{tiny}"), [f"model.path={{model}}", f"data.train_files=[{{data / 'train.parquet'}}]",
                                   "trainer.output_dir={root}/out"])
from megarl.actors.policy_rank import PolicyRank
PolicyRank(cfg, 100)
print(time.perf_counter() - t)
"""


def _seconds(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="megarl-import-bench-"))
    cases = {"import megatron.core (after megarl)": IMPORT,
             "a policy rank built on the demo model (imports included)": BUILD}  # fmt: skip
    rows, raw = [], {}
    for name, template in cases.items():
        lazy, eager = [], []
        for i in range(args.repeats):
            for side, out in (("", lazy), (EAGER, eager)):
                out.append(_seconds(template.format(eager=side, root=root, tiny=ROOT / "configs" / "tiny_grpo.yaml",
                                                    port=29600 + i)))  # fmt: skip
        ratios = [a / b for a, b in zip(lazy, eager, strict=True)]
        rows.append((name, statistics.median(lazy), statistics.median(eager), statistics.median(ratios)))
        raw[name] = {"lazy_s": lazy, "eager_s": eager}
        print(f"{name}: lazy {rows[-1][1]:.2f} s, eager {rows[-1][2]:.2f} s, lazy / eager {rows[-1][3]:.2f}", flush=True)
    machine = describe()
    results = ROOT / "bench" / "results"
    (results / "import_time.json").write_text(json.dumps({"machine": machine, "repeats": args.repeats, "raw": raw}, indent=1) + "\n")
    lines = [f"# Import-time torch.compile made lazy ({machine['date'][:10]})", "",
             f"`bench/import_time.py --repeats {args.repeats}` on {machine['cpu']}, {machine['cores']} cores, load "
             f"{machine['load_avg_1m']} at the end, torch {machine.get('torch')}, megatron-core {machine.get('megatron_core')}. "
             "Fresh processes, the two sides alternating; medians and the median of the pairs' ratios. Raw: `import_time.json`.", "",
             "| case | lazy (s) | eager (s) | lazy / eager |", "|---|---:|---:|---:|",
             *[f"| {n} | {a:.2f} | {b:.2f} | {r:.2f} |" for n, a, b, r in rows]]  # fmt: skip
    (results / "import_time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

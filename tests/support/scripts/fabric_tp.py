"""One rank of tests/fabric/test_fabric_tp.py: trains examples/fabric_tiny_gpt.py once per entry of a JSON list
``[[name, [args...]], ...]`` in this process (a new Fabric each time, the process group reused) and saves
each result as ``<out>/<name>.rank<r>.pt``. The test starts the ranks as torchrun would (LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT in the environment), so Fabric launches nothing itself."""
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "examples"))
import fabric_tiny_gpt as gpt  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)  # 2 ranks on 2 shared cores
    out, runs = Path(sys.argv[1]), json.loads(sys.argv[2])
    for name, args in runs:
        result = gpt.main(args)
        torch.save(result, out / f"{name}.rank{os.environ['LOCAL_RANK']}.pt")

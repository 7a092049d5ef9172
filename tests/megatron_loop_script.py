"""rltrain's CLI with megatron-core on CPU through the test-only shim (for tests/test_megatron.py).

python -m torch.distributed.run --nproc-per-node=2 tests/megatron_loop_script.py --config ... overrides
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_shim import megatron_on_cpu  # noqa: E402
from rltrain.cli import main  # noqa: E402

if __name__ == "__main__":
    with megatron_on_cpu():
        raise SystemExit(main(sys.argv[1:]))

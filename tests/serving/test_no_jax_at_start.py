"""`python -m serving` reads its configuration and flags before JAX starts (GPU_UTILIZATION
and the compile cache must be in the environment by then): the modules it imports first
import no JAX. Checked in a fresh interpreter where importing jax fails."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["jax"] = None  # any `import jax` now raises ImportError
import serving.config, serving.__main__ as main
from serving.config import load_config
config = load_config(None, indexer="hierarchical")
args = main.parse_args(["--mesh", "sequence=2,tensor=2", "--port", "9"])
assert main.check_parallel_flags(args) == 1
assert config.indexer == "hierarchical" and args.mesh == "sequence=2,tensor=2"
assert not any(name == "jax" or name.startswith(("jax.", "flax", "jaxlib"))
               for name, module in sys.modules.items() if module is not None)
print("ok")
"""


def test_serving_config_and_flags_import_no_jax():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]

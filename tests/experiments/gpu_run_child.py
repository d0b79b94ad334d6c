"""A stand-in step for tests/experiments/test_gpu_run.py: `python -m
tests.experiments.gpu_run_child exit N|sleep S [the step's own --out DIR ...]`."""

import sys
import time

if __name__ == "__main__":
    what, value = sys.argv[1], int(sys.argv[2])
    print("child", what, value, "then", sys.argv[3:], flush=True)
    if what == "sleep":
        time.sleep(value)
    sys.exit(value if what == "exit" else 0)

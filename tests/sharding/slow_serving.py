"""`python -m serving` with every prefill chunk made slow on purpose (a sleep before each
Engine.prefill_step; the GIL is released as a long jitted step releases it):

    python -m tests.sharding.slow_serving SECONDS <serving flags>
"""

import sys
import time


def main():
    delay = float(sys.argv[1])
    from serving import engine
    from serving.__main__ import main as serve

    original = engine.Engine.prefill_step

    def slow_prefill_step(self, state, *args, **kwargs):
        time.sleep(delay)
        return original(self, state, *args, **kwargs)

    engine.Engine.prefill_step = slow_prefill_step
    return serve(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())

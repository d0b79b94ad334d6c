"""python -m experiments.costmodel [...]; python -m experiments.costmodel sharding [...]
(sequence-parallel communication and scaling: experiments.costmodel.sharding)."""

import sys

from experiments.costmodel.cli import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["sharding"]:
        from experiments.costmodel.sharding import main as sharding_main

        sharding_main(sys.argv[2:])
    else:
        main()

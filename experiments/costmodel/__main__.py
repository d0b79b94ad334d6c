"""python -m experiments.costmodel [...]; python -m experiments.costmodel sharding [...]
(sequence-parallel communication and scaling: experiments.costmodel.sharding);
python -m experiments.costmodel v4 [...] (DeepSeek-V4-Flash and V4-Pro:
experiments.costmodel.v4)."""

import sys

from experiments.costmodel.cli import main

if __name__ == "__main__":
    if sys.argv[1:2] == ["sharding"]:
        from experiments.costmodel.sharding import main as sharding_main

        sharding_main(sys.argv[2:])
    elif sys.argv[1:2] == ["v4"]:
        from experiments.costmodel.v4 import main as v4_main

        v4_main(sys.argv[2:])
    else:
        main()

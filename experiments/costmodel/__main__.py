"""python -m experiments.costmodel"""

from experiments.costmodel.cli import main

if __name__ == "__main__":
    main()

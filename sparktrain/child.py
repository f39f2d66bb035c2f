"""``python -m sparktrain.child``: the rank process's old entry point, kept for scripts that start
it by name. The rank process is ``sparktrain.executor.child``."""
import sys

from sparktrain.executor.child import leave, main

if __name__ == "__main__":
    leave(main(sys.argv[1:]))

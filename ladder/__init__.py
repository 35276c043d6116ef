"""The machinery the scripts share, a concern per file: the run (folder, logs, checkpoints, signals, torchrun, command
line) and the fast paths (--compile, --cuda-graph, --num-seeds). What it expects of a script: docs/modifying.md."""

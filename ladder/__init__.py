"""The machinery the five scripts share, written once: the run (its folder, logs, checkpoints, signals, torchrun, the
command line) and the fast paths (--compile, --cuda-graph, --num-seeds), one concern per file. The algorithms live in
the scripts, which import what they use from these files. What the package expects of a script: docs/modifying.md."""

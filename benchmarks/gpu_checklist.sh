#!/usr/bin/env bash
# The GPU checklist (docs/benchmarks.md, "On a GPU"): run on a CUDA machine from the repository's root, one part at
# a time (each fits in ten minutes on an H100), logs in $LOGS (default gpu_logs/):
#   bash benchmarks/gpu_checklist.sh correctness   # tests/test_cuda.py, every CartPole script to the end on cuda
#                                                  # at its defaults and at 4096 envs, Brax inverted_pendulum on JAX's GPU
#   bash benchmarks/gpu_checklist.sh cartpole      # env steps/s up to 1M envs; eager / --compile / CUDA graphs / JAX
#   bash benchmarks/gpu_checklist.sh brax          # ant: ppo_mujoco_brax.py against Brax's own PPO
#   bash benchmarks/gpu_checklist.sh graph         # --cuda-graph against the loop and the JAX peer (PPO: 128 to 65,536
#                                                  # envs, eager and compiled; VPG and REINFORCE at 4,096)
#   bash benchmarks/gpu_checklist.sh seeds         # --num-seeds on cuda: the stacked seeds recorded (tests), then
#                                                  # K = 1 and 256 at 128 envs x 100k steps (with --cuda-graph; 256
#                                                  # also with --compile), and
#                                                  # the JAX peer vmapped over 256 seeds
#   bash benchmarks/gpu_checklist.sh sweep         # --sweep on cuda: the sweep's tests, then 16 learning rates x 16
#                                                  # seeds at 128 envs x 100k steps (eager and --compile, each with
#                                                  # --cuda-graph) against the JAX peer vmapped over the same 256 runs
set -u
LOGS=${LOGS:-gpu_logs}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{
  date -u +%Y-%m-%dT%H:%MZ
  nvidia-smi -L
  $PY -c "import torch, jax; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '| jax', jax.__version__, jax.devices())"
} | tee "$LOGS/machine.txt"

# `timed LABEL CMD...`: run CMD, keep its output in $LOGS/LABEL.log, print its exit code, wall seconds and result line
timed() {
  local label=$1
  shift
  local start=$(date +%s%N)
  "$@" >"$LOGS/$label.log" 2>&1
  local rc=$? ms=$((($(date +%s%N) - start) / 1000000))
  printf '%-34s rc=%s %5d.%03d s  %s\n' "$label" "$rc" $((ms / 1000)) $((ms % 1000)) \
    "$(grep -v '^note:' "$LOGS/$label.log" | tail -1 | cut -c1-200)"
}

case "${1:-}" in
correctness)
  timeout 330 $PY -m pytest tests/test_cuda.py -rA -p no:cacheprovider 2>&1 | tail -40 | tee "$LOGS/test_cuda.log"
  for script in ppo_cartpole_gpu vpg reinforce; do
    timed "$script.cuda.defaults" timeout 120 $PY $script.py --device cuda --no-progress-bar
    timed "$script.cuda.4096" timeout 120 $PY $script.py --device cuda --no-progress-bar --num-envs 4096
  done
  timed "ppo_cartpole_gpu.cuda.compile" timeout 120 $PY ppo_cartpole_gpu.py --device cuda --no-progress-bar --compile
  timed "brax.inverted_pendulum.cuda" timeout 200 $PY ppo_mujoco_brax.py --env-id inverted_pendulum --device cuda \
    --total-timesteps 2000000 --target-return 900 --no-progress-bar
  ;;
cartpole)
  timeout 560 $PY benchmarks/cartpole.py --device cuda --env-sizes 4096 65536 1048576 --peer-sizes 4096 65536 \
    --solve-up-to 4096 --peer-seeds 1 --seeds 1 --skip-busy --skip-baseline --seconds-per-measure 0.5 \
    --logdir "$LOGS/cartpole" 2>&1 | tee "$LOGS/cartpole.log"
  ;;
brax)
  timeout 560 $PY benchmarks/brax_ppo.py --env-id ant --num-envs 4096 --iterations 20 2>&1 | tee "$LOGS/brax.log"
  ;;
graph)
  timeout 420 $PY benchmarks/cuda_graph.py --sizes 128 4096 65536 --modes loop graph loop-compile graph-compile \
    --iterations 100 2>&1 | tee "$LOGS/graph_ppo.log"
  # issue 66: PPO's compiled epochs and VPG's compiled iteration, recorded in the CUDA graph (goal: PPO >= 0.9x the
  # JAX peer at 4,096 envs with --compile)
  timeout 240 $PY benchmarks/cuda_graph.py --scripts vpg reinforce --sizes 4096 --modes loop graph graph-compile \
    --iterations 100 --no-jax 2>&1 | tee "$LOGS/graph_vpg_reinforce.log"
  ;;
seeds)
  timeout 240 $PY -m pytest -q tests/test_cuda.py -k stacked 2>&1 | tee "$LOGS/seeds_tests.log"
  for k in 1 256; do
    timed "seeds_$k" $PY ppo_cartpole_gpu.py --num-seeds $k --cuda-graph --total-timesteps 100000 \
      --target-return None --eval-episodes 0 --no-progress-bar --exp-name "seeds$k"
  done
  timed seeds_256_compile $PY ppo_cartpole_gpu.py --num-seeds 256 --compile --cuda-graph --total-timesteps 100000 \
    --target-return None --eval-episodes 0 --no-progress-bar --exp-name seeds256c  # compiling apart: setup_parts
  timed seeds_jax_256 $PY benchmarks/jax_ppo_cartpole.py --num-seeds 256 --total-timesteps 100000 \
    --target-return inf
  ;;
sweep)
  timeout 300 $PY -m pytest -q tests/test_sweep.py 2>&1 | tee "$LOGS/sweep_tests.log"
  LRS=$($PY -c "import numpy as np; print(','.join(f'{x:.3g}' for x in np.geomspace(1e-4, 3e-2, 16)))")
  for mode in eager compile; do
    timed "sweep_$mode" $PY ppo_cartpole_gpu.py --sweep "learning-rate=$LRS" --num-seeds 16 --cuda-graph \
      $([ $mode = compile ] && echo --compile) --total-timesteps 100000 --target-return None --eval-episodes 0 \
      --no-progress-bar --exp-name "sweep_$mode"  # compiling apart: setup_parts in each run's summary.json
  done
  timed sweep_jax $PY benchmarks/jax_ppo_cartpole.py --learning-rates "$LRS" --num-seeds 16 \
    --total-timesteps 100000 --target-return inf
  ;;
*)
  echo "usage: bash benchmarks/gpu_checklist.sh correctness|cartpole|brax|graph|seeds|sweep" >&2
  exit 2
  ;;
esac

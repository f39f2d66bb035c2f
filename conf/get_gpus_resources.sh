#!/usr/bin/env bash
# GPU discovery script for Spark: prints the GPUs of this node as Spark's resource JSON,
#   {"name": "gpu", "addresses": ["0", "1"]}
# Spark runs it when an executor (YARN, Kubernetes) or a worker (standalone) starts, if
# spark.executor.resource.gpu.discoveryScript or spark.worker.resource.gpu.discoveryScript names it.
#
# The addresses are nvidia-smi's GPU indices. Where CUDA_VISIBLE_DEVICES already restricts the
# GPUs (set and not empty), they are positions in that list (0, 1, ...), which is how sparktrain
# maps them back.
#
# Finding no GPU is an error (exit 1, with the reason on stderr, which Spark puts in its log):
# Spark calls this script only when GPUs were asked for, so a node without them is misconfigured.
# Only bash builtins are used, so the script runs on minimal images.

fail() {
  echo "get_gpus_resources.sh: $*" >&2
  exit 1
}

command -v nvidia-smi >/dev/null 2>&1 ||
  fail "nvidia-smi is not on PATH ($PATH); install the NVIDIA driver on this node, or unset spark.task.resource.gpu.amount to train on CPU"

if ! listing=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>&1); then
  fail "nvidia-smi failed: ${listing}"
fi

indices=()
while IFS= read -r line; do
  line=${line//[[:space:]]/}
  [[ $line =~ ^[0-9]+$ ]] && indices+=("$line")
done <<<"$listing"
((${#indices[@]} > 0)) || fail "nvidia-smi lists no GPU on this node"

if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
  IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
  indices=()
  for entry in "${visible[@]}"; do
    entry=${entry//[[:space:]]/}
    [[ -n $entry && $entry != -1 ]] && indices+=("${#indices[@]}")
  done
  ((${#indices[@]} > 0)) || fail "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' hides every GPU from this node's executors"
fi

addresses=""
for index in "${indices[@]}"; do
  addresses+="${addresses:+, }\"$index\""
done
echo "{\"name\": \"gpu\", \"addresses\": [$addresses]}"

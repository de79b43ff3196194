#!/usr/bin/env bash
# The offload plugin's benchmarks (docs/results/offload.md), one command:
#  (a) the step time of bench/offload.toml with optimizer = "host" and "nvme", and with the
#      parameter shards on the host too (zero3, parameters = "host"), and with amp the parameter
#      shards on the host and on the NVMe tier (parameters = "nvme"), against no offload,
#      interleaved (bench/cpu_interleave.py, side by side in one run);
#  (b) the host AdamW's update (bench_optimizer_kernels: the kernel the host place runs) against
#      PyTorch's torch.optim.AdamW on the CPU (bench/torch_adamw_rate.py), same shapes, threads;
#  (c) the NVMe tier's read and write rates (bench_state_file) against fio on the same folder,
#      the same direct flag, block size (1 MiB) and queue depth (1: one linked chain in flight).
#
#   bench/offload.sh NVME_DIR [TORCH_PYTHON]
# NVME_DIR: the folder for the state files and fio's file (a folder on the NVMe disk). Needs
# build/bin/{headroom,bench_optimizer_kernels,bench_state_file} and the offload plugin built.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: bench/offload.sh NVME_DIR [TORCH_PYTHON]}
py=${2:-bench/.venv-torch/bin/python}
threads=$(nproc)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== $(date -u '+%F %H:%M UTC'), $(nproc) cores, $(uptime)"
echo "== $dir: $(df -T "$dir" | tail -1 | awk '{print $2}')"

echo "== (a) step time: none, host, nvme, host + parameters"
cp bench/offload.toml "$tmp/none.toml"
{ cat bench/offload.toml; printf '[[plugins]]\nname = "offload"\noptimizer = "host"\n'; } \
  >"$tmp/host.toml"
{ cat bench/offload.toml
  printf '[[plugins]]\nname = "offload"\noptimizer = "nvme"\nnvme_path = "%s"\n' "$dir"; } \
  >"$tmp/nvme.toml"
# and the parameter shards on the host too (zero3 at its defaults, parameters = "host").
{ cat bench/offload.toml; printf '[[plugins]]\nname = "zero3"\n'
  printf '[[plugins]]\nname = "offload"\noptimizer = "host"\nparameters = "host"\n'; } \
  >"$tmp/params.toml"
# With amp: the parameter shards on the host, and their NVMe tier (parameters = "nvme": the bf16
# shards in a file under NVME_DIR, read ahead at each gathering).
{ cat bench/offload.toml; printf '[[plugins]]\nname = "amp"\n[[plugins]]\nname = "zero3"\n'
  printf '[[plugins]]\nname = "offload"\noptimizer = "host"\nparameters = "host"\n'; } \
  >"$tmp/amp_params.toml"
{ cat bench/offload.toml; printf '[[plugins]]\nname = "amp"\n[[plugins]]\nname = "zero3"\n'
  printf '[[plugins]]\nname = "offload"\noptimizer = "host"\nparameters = "nvme"\n'
  printf 'nvme_path = "%s"\n' "$dir"; } >"$tmp/amp_params_nvme.toml"
python3 bench/cpu_interleave.py "$tmp/none.toml" none=build/bin/headroom \
  host=build/bin/headroom@"$tmp/host.toml" nvme=build/bin/headroom@"$tmp/nvme.toml" \
  params=build/bin/headroom@"$tmp/params.toml" \
  amp_params=build/bin/headroom@"$tmp/amp_params.toml" \
  amp_params_nvme=build/bin/headroom@"$tmp/amp_params_nvme.toml" \
  --steps "${STEPS:-6}" --rounds "${ROUNDS:-3}"

echo "== (b) AdamW update, gpt2-124m shapes, $threads threads"
# Alternated, round by round: one process each cannot share a round, and the load of a shared
# machine changes between processes.
for r in $(seq "${AROUNDS:-3}"); do
  echo "-- round $r"
  build/bin/bench_optimizer_kernels --reps 3 --threads "$threads" 2>/dev/null | grep "built-in AdamW"
  "$py" bench/torch_adamw_rate.py --reps 3 --threads "$threads" | tail -n +3
done

echo "== (c) the state file against fio"
build/bin/bench_state_file --dir "$dir" --reps 3
size=950M  # gpt2-124m's m and v in f32: 124.4 M parameters x 8 bytes
for rw in write read; do
  fio --name="state-$rw" --filename="$dir/headroom-fio.dat" --rw="$rw" --bs=1M --size="$size" \
    --direct="${FIO_DIRECT:-1}" --ioengine=io_uring --iodepth=1 --numjobs=1 --loops=3 \
    --output-format=json |
    python3 -c "import json, sys; j = json.load(sys.stdin)['jobs'][0]['$rw']
print(f'fio $rw: {j[\"bw_bytes\"] / 1e6:.0f} MB/s (bs 1M, iodepth 1, direct=${FIO_DIRECT:-1}, io_uring)')"
done
rm -f "$dir/headroom-fio.dat"

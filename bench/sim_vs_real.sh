#!/usr/bin/env bash
# The simulator against the real runtime on this machine (docs/simulator.md, "Simulator vs
# fcp run"). Calibrates a CPU profile the way `fcp run` computes — under mpirun, one process
# bound to each core as the run's ranks are, both busy at once, with the run's head shape, the
# kernels timed sustained (`--sustained`: back to back, forward pairs with their merges, mean
# of the repeats) — and measures MPI bandwidth between two ranks; runs `fcp run` on 2 ranks
# with plans made from that profile's curve; simulates the same plans on the profile; prints
# measured, simulated and the error per strategy. The whole trial repeats FCP_TRIALS times
# (default 3; the machine is shared and a run's speed drifts) and the median error is the
# result.
# Usage: bench/sim_vs_real.sh [OUT_DIR] (after scripts/build.sh; about 3 minutes per trial).
#
# The curve comes from Zig-Zag pairs (`fcp bench kernel --mask zigzag`: every pair of a causal
# sequence cut into 4 Zig-Zag blocks; FCP_CURVE_MASK=causal or full for self pairs): every
# block of the run's batch is a Zig-Zag block of a long sequence, and its pairs are what the
# runtime times (docs/simulator.md). FCP_TIMING=best calibrates at the kernels' best instead.
set -euo pipefail
cd "$(dirname "$0")/.."
fcp=${FCP:-build/apps/fcp/fcp}
bandwidth=${FCP_BANDWIDTH_BENCH:-build/bench/mpi_bandwidth_bench}
root=${1:-build/sim_vs_real}
repeats=${FCP_REPEATS:-3}
trials=${FCP_TRIALS:-3}
curve_mask=${FCP_CURVE_MASK:-zigzag}
timing=${FCP_TIMING:-sustained}
if ! [[ $trials =~ ^[1-9][0-9]*$ ]]; then
  echo "sim_vs_real.sh: invalid FCP_TRIALS '$trials': expected a positive integer" >&2; exit 2
fi
case "$timing" in
  sustained) timing_flag=(--sustained) ;;
  best) timing_flag=() ;;
  *) echo "sim_vs_real.sh: invalid FCP_TIMING '$timing': expected sustained or best" >&2; exit 2 ;;
esac
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
shape=(--heads-q 8 --heads-kv 1 --head-dim 64)
batch=(--workload lognormal --seed 0 --tokens-per-worker 8K --block-size 2K --memory-slack 0.1 --mask causal)

for trial in $(seq 1 "$trials"); do
out=$root/trial$trial
mkdir -p "$out"
echo "trial $trial of $trials" >&2
echo "1/4 kernel curve: fcp bench kernel on both cores at once, bound as the run's ranks" >&2
# Each rank writes its own curve and table (the rank's number from Open MPI's environment).
mpirun -n 2 bash -c 'out=$1; shift; r=${OMPI_COMM_WORLD_RANK:?needs Open MPI}; "$@" --curve-out "$out/curve$r.json" > "$out/kernel$r.txt"' \
  _ "$out" "$fcp" bench kernel "${timing_flag[@]}" --mask "$curve_mask" --tokens 128 256 512 1K 2K 4K "${shape[@]}" \
  --min-seconds 0.5

echo "2/4 MPI bandwidth between two ranks" >&2
mpirun -n 2 "$bandwidth" 1 16 > "$out/bandwidth.txt"

/usr/bin/python3 - "$out" "$curve_mask" "$timing" <<'PY'
import json, re, sys
out = sys.argv[1]
curves = [json.load(open(f"{out}/curve{r}.json")) for r in (0, 1)]
peak = sum(c["peak_gflops"] for c in curves) / 2
def mean_curve(direction):
    points = {}
    for c in curves:
        for tokens, fraction in c[direction]:
            points.setdefault(tokens, []).append(fraction * c["peak_gflops"])
    return [[t, round(sum(g) / len(g) / peak, 4)] for t, g in sorted(points.items())]
text = open(f"{out}/bandwidth.txt").read()
gbps = float(re.search(r"1 MiB each way: median ([0-9.]+) GB/s", text).group(1))
profile = {
    "kind": "fcp-hardware", "name": "cpu-measured",
    "note": "made by bench/sim_vs_real.sh: kernel curve from `fcp bench kernel "
            f"--mask {sys.argv[2]} --heads-q 8 --heads-kv 1 --head-dim 64` on two ranks at once, "
            f"one bound to each core ({sys.argv[3]} timing; mean GFLOP/s over both, as fractions of "
            "their mean sgemm peak); network: median GB/s each way of 1 MiB messages (a 2K "
            "block's K and V) between two ranks",
    "peak_tflops": peak / 1000, "workers_per_node": 2,
    "intra_node_gbps": gbps, "inter_node_gbps": gbps,
    "intra_node_latency_us": 20, "inter_node_latency_us": 20,
    "forward": mean_curve("forward"), "backward": mean_curve("backward")}
json.dump(profile, open(f"{out}/cpu.json", "w"), indent=1)
print(f"profile: peak {peak:.1f} GFLOP/s, network {gbps:.2f} GB/s, forward {profile['forward']}",
      file=sys.stderr)
PY

echo "3/4 fcp run on 2 ranks (warmup 1, $repeats repeats, medians)" >&2
mpirun -n 2 "$fcp" run "${batch[@]}" "${shape[@]}" --curve "$out/cpu.json" --strategy fcp,ring \
  --threads 1 --warmup 1 --repeats "$repeats" --json > "$out/run.jsonl"

echo "4/4 fcp simulate of the same plans" >&2
"$fcp" simulate --hardware "$out/cpu.json" --workers 2 --strategy fcp,ring "${batch[@]}" "${shape[@]}" \
  --dtype fp32 --coalesce 16 --buffers 3 --batches 1 --json > "$out/sim.jsonl"

/usr/bin/python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
run = {r["strategy"]: r for r in map(json.loads, open(f"{out}/run.jsonl"))}
sim = {r["strategy"]: r for r in map(json.loads, open(f"{out}/sim.jsonl"))}
rows = []
for s in ("fcp", "ring"):
    m, p = run[s], sim[s]
    mt, pt = m["fwd_ms"] + m["bwd_ms"], p["forward_ms"] + p["backward_ms"]
    rows.append({"strategy": s, "measured_fwd_ms": m["fwd_ms"], "measured_bwd_ms": m["bwd_ms"],
                 "simulated_fwd_ms": p["forward_ms"], "simulated_bwd_ms": p["backward_ms"],
                 "error": pt / mt - 1, "kernel_gflops": m["kernel_gflops"]})
with open(f"{out}/result.json", "w") as f:
    json.dump(rows, f, indent=1)
PY
done

/usr/bin/python3 - "$root" "$trials" <<'PY'
import json, statistics, sys
root, trials = sys.argv[1], int(sys.argv[2])
results = [json.load(open(f"{root}/trial{t}/result.json")) for t in range(1, trials + 1)]
print("| trial | strategy | measured fwd / bwd / total ms | simulated fwd / bwd / total ms | error | kernel GFLOP/s in the run |")
print("|---|---|---|---|---|---|")
for t, rows in enumerate(results, 1):
    for r in rows:
        mt = r["measured_fwd_ms"] + r["measured_bwd_ms"]
        pt = r["simulated_fwd_ms"] + r["simulated_bwd_ms"]
        print(f"| {t} | {r['strategy']} | {r['measured_fwd_ms']:.0f} / {r['measured_bwd_ms']:.0f} / {mt:.0f} | "
              f"{r['simulated_fwd_ms']:.0f} / {r['simulated_bwd_ms']:.0f} / {pt:.0f} | "
              f"{100 * r['error']:+.1f} % | {r['kernel_gflops']:.1f} |")
for s in ("fcp", "ring"):
    errors = [r["error"] for rows in results for r in rows if r["strategy"] == s]
    print(f"{s}: median error {100 * statistics.median(errors):+.1f} % over {len(errors)} trial(s) "
          f"(range {100 * min(errors):+.1f} to {100 * max(errors):+.1f} %)")
PY

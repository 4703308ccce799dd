#!/usr/bin/env bash
# Every GPU check of graphshard in one pass, for a GPU machine lent for a few minutes with
# torch already installed (nothing else installable): the CUDA test tier first (is it
# right?), then the bench's GPU rows (is it fast?), each stage under its own time limit so
# that a slow stage cannot eat the ones after it. Results and logs go to $OUT (default
# gpu_out/); a stage that ran out of time says so in summary.txt and the next one starts.
#
#   OUT=/some/dir bash bench/gpu_check.sh     # tier, bench1, offload: at most 10 minutes
#   STAGES="medium bench8" bash bench/gpu_check.sh   # a second call: llama-medium, fake world
#   TIER_S=300 BENCH1_S=200 bash bench/gpu_check.sh   # other limits per stage (seconds)
#
# Stages (in order):
#   tier     python -m pytest tests/gpu (the CUDA tier: offload, training, state, fake world)
#   bench1   world 1, 0.9B Llama (llama-1b) in bf16, every system with fused AdamW (whose step
#            graphshard runs on the shards' local tensors): graphshard, and with
#            reshard_after_forward="auto" (no second cast of the weights in the backward),
#            against one process (issue 26's target: at most 1.02x), with each system's
#            device time (busy, idle, largest kernels: bench/device_time.py). Every system
#            keeps ~17 GB on the device (fp32 weights, gradients, AdamW state), so FSDP2 +
#            compile (0.48-0.63x graphshard's speed on the H100) is left out: 4 of them would
#            crowd an 80 GB card
#   medium   world 1, llama-medium in fp32, batch 8x512: graphshard against one process
#            (issue 26's target: at most 1.10x) and DDP + compile, with device time
#   offload  world 1, llama-1b in bf16: CPU offload, graphshard's compiled, with the
#            copies on copy streams (grad_copy_stream=True and shard_copy_stream=True: the
#            gradients' overlap the shards' the other way, the shards' are issued a bucket
#            ahead of their use), and that with reshard_after_forward="auto" too
#            (which keeps the gathered parameters on an 80 GB card: the shards cross the bus
#            once a step, not twice), against FSDP2's (eager) and graphshard without offload
#            (issue 23's targets). Each offloading system keeps ~18 GB of fp32 state in host
#            memory (4 of them here).
#            The step includes AdamW on the host; a compiled row's forward + backward is its
#            step less the host-tax "optimizer" column
#   bench8   fake world of 8, llama-1b in bf16: graphshard against SimpleFSDP's block and
#            auto bucketing (where torchtitan is installed; auto's estimator needs the fake
#            world's registered device type). A cold compile of three 1B systems takes
#            minutes: not in the default stages.
# On 2026-11-27 (H200, torch 2.11): tier 71 s, bench1 118 s, bench8 171 s with a partly
# warm Inductor cache (it ran out of 170 s cold). On the H100 (torch 2.11): tier 128 s (5
# workers), offload 140 s; bench1 ran out of 150 s and medium of 90 s cold (warm: 92 s, 48 s).
# The bench rows record each system's first step too (`compile s`, a cold Inductor cache).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
STAGES=${STAGES:-"tier bench1 offload"}
mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/graphshard_gpu_check_cache"  # not brought back
summary="$OUT/summary.txt"
: > "$summary"

python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 \
    || python -m pip install -q --no-deps -e . >> "$OUT/install.log" 2>&1
python - > "$OUT/device.txt" 2>&1 <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
EOF
cat "$OUT/device.txt" >> "$summary"

stage() {  # stage NAME SECONDS COMMAND...: run it under a limit, note how it ended
    local name=$1 limit=$2
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    local start=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local how="exit $rc"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && how="ran out of its ${limit} s"
    echo "$name: $how after $((SECONDS - start)) s" >> "$summary"
}

# The tier's cases are independent (each module's group lives in its worker), so pytest-xdist,
# where installed, spreads them over processes that compile side by side.
workers=()
python -c "import xdist" 2>/dev/null && workers=(-n "${TIER_WORKERS:-6}" --dist load)
stage tier "${TIER_S:-150}" python -m pytest -q -p no:cacheprovider "${workers[@]}" tests/gpu \
    --junitxml="$OUT/tier.xml"
stage bench1 "${BENCH1_S:-210}" python -m bench.step --device cuda --world-size 1 --model llama-1b \
    --mixed-precision bf16 --batch-size 2 --seq-len 1024 --steps 12 --warmup 3 \
    --optimizer fused --host-tax-steps 2 --device-profile-steps 2 \
    --systems graphshard-compiled 'graphshard-compiled[reshard_after_forward=auto]' \
    single-compiled \
    --json "$OUT/bench1.json" --markdown "$OUT/bench1.md"
stage medium "${MEDIUM_S:-150}" python -m bench.step --device cuda --world-size 1 \
    --model llama-medium --batch-size 8 --seq-len 512 --steps 12 --warmup 3 \
    --optimizer fused --host-tax-steps 2 --device-profile-steps 2 \
    --systems graphshard-compiled single-compiled ddp-compiled \
    --json "$OUT/medium.json" --markdown "$OUT/medium.md"
stage offload "${OFFLOAD_S:-230}" python -m bench.step --device cuda --world-size 1 \
    --model llama-1b --mixed-precision bf16 --batch-size 2 --seq-len 1024 --steps 6 --warmup 2 \
    --optimizer fused --host-tax-steps 2 --systems graphshard-offload-compiled \
    'graphshard-offload-compiled[grad_copy_stream=True,shard_copy_stream=True]' \
    'graphshard-offload-compiled[reshard_after_forward=auto,grad_copy_stream=True,shard_copy_stream=True]' \
    fsdp2-offload-eager graphshard-compiled \
    --json "$OUT/offload.json" --markdown "$OUT/offload.md"
stage bench8 "${BENCH8_S:-330}" python -m bench.step --device cuda --fake-world 8 --model llama-1b \
    --mixed-precision bf16 --batch-size 2 --seq-len 1024 --steps 12 --warmup 3 \
    --host-tax-steps 0 --device-profile-steps 2 --systems graphshard-compiled \
    simplefsdp-block-bucketing simplefsdp-auto-bucketing \
    --json "$OUT/bench8.json" --markdown "$OUT/bench8.md"
cat "$summary"

#!/usr/bin/env bash
# Every GPU check of graphshard in one pass, for a GPU machine lent for a few minutes with
# torch already installed (nothing else installable): the CUDA test tier first (is it
# right?), then the bench's GPU rows (is it fast?). The whole pass keeps to one deadline
# (DEADLINE_S, default 560 s): each stage runs under its own limit, cut to the time left, and
# a stage with under 30 s left is skipped. Results and logs go to $OUT (default gpu_out/);
# summary.txt says how each stage ended.
#
#   OUT=/some/dir bash bench/gpu_check.sh            # tier+warm, bench1, offload, bench8, eager8
#   STAGES="medium" DEADLINE_S=200 bash bench/gpu_check.sh   # a second call: llama-medium
#   TIER_S=200 BENCH1_S=100 bash bench/gpu_check.sh   # other limits per stage (seconds)
#   TIER_K="activation_checkpointing or compile_mode or cpp_wrapper" bash bench/gpu_check.sh
#        # the tier's cases that pytest -k selects (a rerun of the ones a fix touched)
#   GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh       # print each command, run nothing
#   OUT=$OUT RESULTS=/tmp/r bash bench/gpu_check.sh   # results in /tmp/r, packed after each
#        stage into $OUT/results.tar.gz beside summary.txt (for a tool that brings back a few
#        files only: the device tool returns 8)
#
# Stages (in order):
#   tier     python -m pytest tests/gpu (the CUDA tier: offload, training, state, fake world).
#            While it runs, the compiled systems of the later stages named in WARM (default
#            "bench1 bench8") each run two steps in a process of their own (nice, two compile
#            threads), which fills the Inductor cache: the timed stages then compile warm.
#            Their logs: warm-*.log; they time nothing
#   bench1   world 1, 0.9B Llama (llama-1b) in bf16, every system with fused AdamW (whose step
#            graphshard runs on the shards' local tensors): graphshard, and with
#            reshard_after_forward="auto" (no second cast of the weights in the backward),
#            against one process (issue 26's target: at most 1.02x), with each system's
#            device time (busy, idle, largest kernels: bench/device_time.py). Every system
#            keeps ~17 GB on the device (fp32 weights, gradients, AdamW state), so FSDP2 +
#            compile (0.48-0.63x graphshard's speed on the H100) is left out
#   offload  world 1, llama-1b in bf16: CPU offload. graphshard's compiled step (its copies
#            on copy streams: the gradients' overlap the shards' the other way, the shards'
#            are issued a bucket ahead of their use), and with both copy streams off (every
#            copy on the compute stream); graphshard's eager step; against FSDP2's (eager)
#            and graphshard without offload (issue 23's targets). Each offloading
#            system keeps ~18 GB of fp32 state in host memory (4 of them here). The step
#            includes AdamW on the host; a compiled row's forward + backward is its step less
#            the host-tax "optimizer" column
#   offload8 the same at batch 8 x 1024: graphshard's compiled offload step against its step
#            without offload, where the forward + backward has four times the compute to hide
#            the same bytes under (at batch 2 the copies alone take 3.5x the compute:
#            docs/cpu-offload.md); not a default stage
#   bench8   fake world of 8, llama-1b in bf16: graphshard against SimpleFSDP's block and
#            auto bucketing (where torchtitan is installed; auto's estimator needs the fake
#            world's registered device type). On a machine where nothing installs, carry
#            torchtitan as wheels, fetched beforehand where pip reaches an index:
#              pip download --no-deps -d .whl torchtitan==0.3.0 spmd_types tyro \
#                docstring_parser typeguard
#            and install them there first:
#              pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#              export PYTHONPATH=/tmp/site
#   eager8   fake world of 8, llama-1b in bf16, eager: graphshard (a bucket at a time, each
#            gather issued a bucket ahead), with reshard_after_forward=False, against FSDP2
#   medium   world 1, llama-medium in fp32, batch 8x512: graphshard against one process
#            (issue 26's target: at most 1.10x) and DDP + compile, with device time
# On 2026-11-27 (H200, torch 2.11), each stage alone and cold: tier 71 s, bench1 118 s,
# bench8 over 170 s. On the H100: tier 128 s (5 workers), offload 140 s, medium 90 s.
# The bench rows record each system's first step too (`compile s`: warm where WARM named
# the stage).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
STAGES=${STAGES:-"tier bench1 offload bench8 eager8"}
WARM=${WARM:-"bench1 bench8"}
DEADLINE=$((SECONDS + ${DEADLINE_S:-560}))
RESULTS=${RESULTS:-$OUT}
DRY=${GPU_CHECK_DRY_RUN:-}
export TORCHINDUCTOR_CACHE_DIR="${TMPDIR:-/tmp}/graphshard_gpu_check_cache"  # not brought back
summary="$RESULTS/summary.txt"
[ -n "$DRY" ] || { mkdir -p "$OUT" "$RESULTS" && : > "$summary"; }

pack() {  # with RESULTS apart from OUT: the summary and one archive of everything in OUT
    [ -z "$DRY" ] && [ "$RESULTS" != "$OUT" ] || return 0
    cp "$summary" "$OUT/summary.txt"
    tar -czf "$OUT/results.tar.gz" -C "$RESULTS" . 2>/dev/null
}

[ -n "$DRY" ] || { python -m pip install -q --no-deps --no-build-isolation -e . > "$RESULTS/install.log" 2>&1 \
    || python -m pip install -q --no-deps -e . >> "$RESULTS/install.log" 2>&1
python - > "$RESULTS/device.txt" 2>&1 <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
try:
    import torchtitan
    print("torchtitan", getattr(torchtitan, "__version__", "installed"))
except ImportError as exc:
    print("torchtitan not installed:", exc)
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    >> "$RESULTS/device.txt" 2>&1
nproc >> "$RESULTS/device.txt"
cat "$RESULTS/device.txt" >> "$summary"
}

named() { case " $1 " in *" $2 "*) return 0 ;; *) return 1 ;; esac; }

# Each bench stage's arguments; the warm-up reuses them with two steps.
L1B=(--device cuda --model llama-1b --mixed-precision bf16 --batch-size 2 --seq-len 1024)
BENCH1=("${L1B[@]}" --world-size 1 --optimizer fused)
BENCH1_SYSTEMS=(graphshard-compiled 'graphshard-compiled[reshard_after_forward=auto]'
    single-compiled)
OFFLOAD=("${L1B[@]}" --world-size 1 --optimizer fused)
OFFLOAD_SYSTEMS=(graphshard-offload-compiled
    'graphshard-offload-compiled[grad_copy_stream=False,shard_copy_stream=False]'
    graphshard-offload-eager fsdp2-offload-eager graphshard-compiled)
OFFLOAD8=("${OFFLOAD[@]}" --batch-size 8)  # the offload stage's, at batch 8 (the last value counts)
OFFLOAD8_SYSTEMS=(graphshard-offload-compiled graphshard-compiled)
BENCH8=("${L1B[@]}" --fake-world 8)
BENCH8_SYSTEMS=(graphshard-compiled simplefsdp-block-bucketing simplefsdp-auto-bucketing)
EAGER8_SYSTEMS=(graphshard-eager 'graphshard-eager[reshard_after_forward=False]' fsdp2-eager)
MEDIUM=(--device cuda --world-size 1 --model llama-medium --batch-size 8 --seq-len 512
    --optimizer fused)
MEDIUM_SYSTEMS=(graphshard-compiled single-compiled ddp-compiled)

stage() {  # stage NAME SECONDS COMMAND...: run it under a limit cut to the deadline
    local name=$1 limit=$2
    shift 2
    named "$STAGES" "$name" || return 0
    if [ -n "$DRY" ]; then printf 'stage %s' "$name"; printf ' %q' "$@"; echo; return 0; fi
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "$name: skipped, ${left} s left before the deadline" >> "$summary"
        return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    local start=$SECONDS
    timeout --signal=INT --kill-after=20 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    local how="exit $rc"
    { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && how="ran out of its ${limit} s"
    echo "$name: $how after $((SECONDS - start)) s" >> "$summary"
    pack
}

warm_pids=()
warm() {  # warm STAGE ARGS-ARRAY-NAME SYSTEMS...: one background process per compiled system
    local name=$1 args_name=$2
    shift 2
    named "$STAGES" "$name" && named "$WARM" "$name" || return 0
    local -n args=$args_name
    local i=0
    for system in "$@"; do
        case "$system" in *-eager*) continue ;; esac
        i=$((i + 1))
        local cmd=(python -m bench.step "${args[@]}" --steps 2 --warmup 1 --host-tax-steps 0
                   --systems "$system" --json "${TMPDIR:-/tmp}/warm-$name-$i.json")
        if [ -n "$DRY" ]; then printf 'warm %s' "$name-$i"; printf ' %q' "${cmd[@]}"; echo; continue; fi
        TORCHINDUCTOR_COMPILE_THREADS=2 nice -n 10 timeout --kill-after=10 "${WARM_S:-200}" \
            "${cmd[@]}" > "$RESULTS/warm-$name-$i.log" 2>&1 &
        warm_pids+=($!)
    done
}

warm bench1 BENCH1 "${BENCH1_SYSTEMS[@]}"
warm offload OFFLOAD "${OFFLOAD_SYSTEMS[@]}"  # not by default: ~18 GB of host memory each
warm offload8 OFFLOAD8 "${OFFLOAD8_SYSTEMS[@]}"
warm bench8 BENCH8 "${BENCH8_SYSTEMS[@]}"
warm medium MEDIUM "${MEDIUM_SYSTEMS[@]}"

# The tier's cases are independent (each module's group lives in its worker), so pytest-xdist,
# where installed, spreads them over processes that compile side by side.
workers=()
python -c "import xdist" 2>/dev/null && workers=(-n "${TIER_WORKERS:-6}" --dist load)
tier_k=()
[ -n "${TIER_K:-}" ] && tier_k=(-k "$TIER_K")
stage tier "${TIER_S:-280}" python -m pytest -q -p no:cacheprovider "${workers[@]}" tests/gpu \
    "${tier_k[@]}" --junitxml="$RESULTS/tier.xml"
if [ "${#warm_pids[@]}" -gt 0 ]; then
    start=$SECONDS
    wait "${warm_pids[@]}"
    echo "warm-up: ${#warm_pids[@]} processes done $((SECONDS - start)) s after the tier" \
        >> "$summary"
fi
stage bench1 "${BENCH1_S:-150}" python -m bench.step "${BENCH1[@]}" --steps 12 --warmup 3 \
    --host-tax-steps 2 --device-profile-steps 2 --systems "${BENCH1_SYSTEMS[@]}" \
    --json "$RESULTS/bench1.json" --markdown "$RESULTS/bench1.md"
stage offload "${OFFLOAD_S:-230}" python -m bench.step "${OFFLOAD[@]}" --steps 6 --warmup 2 \
    --host-tax-steps 2 --systems "${OFFLOAD_SYSTEMS[@]}" \
    --json "$RESULTS/offload.json" --markdown "$RESULTS/offload.md"
stage offload8 "${OFFLOAD8_S:-200}" python -m bench.step "${OFFLOAD8[@]}" --steps 6 --warmup 2 \
    --host-tax-steps 2 --systems "${OFFLOAD8_SYSTEMS[@]}" \
    --json "$RESULTS/offload8.json" --markdown "$RESULTS/offload8.md"
stage bench8 "${BENCH8_S:-200}" python -m bench.step "${BENCH8[@]}" --steps 12 --warmup 3 \
    --host-tax-steps 0 --device-profile-steps 2 --systems "${BENCH8_SYSTEMS[@]}" \
    --json "$RESULTS/bench8.json" --markdown "$RESULTS/bench8.md"
stage eager8 "${EAGER8_S:-90}" python -m bench.step "${BENCH8[@]}" --steps 10 --warmup 2 \
    --host-tax-steps 0 --device-profile-steps 2 --systems "${EAGER8_SYSTEMS[@]}" \
    --json "$RESULTS/eager8.json" --markdown "$RESULTS/eager8.md"
stage medium "${MEDIUM_S:-150}" python -m bench.step "${MEDIUM[@]}" --steps 12 --warmup 3 \
    --host-tax-steps 2 --device-profile-steps 2 --systems "${MEDIUM_SYSTEMS[@]}" \
    --json "$RESULTS/medium.json" --markdown "$RESULTS/medium.md"
pack
[ -n "$DRY" ] || cat "$summary"

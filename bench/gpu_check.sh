#!/usr/bin/env bash
# One short GPU check of shoal, as one device command (the machine: one H100 or H200, python3
# with torch, no network), from the repo root with $OUT set:
#
#   bash bench/gpu_check.sh                                  # the device; carry .whl
#   GPU_CHECK_DRY=1 OUT=/tmp/gpuout bash bench/gpu_check.sh  # here: CPU, tiny sizes, no 8B
#
# Parts, in this order (each under `timeout`, all inside one deadline, GPU_CHECK_BUDGET_S,
# default 540 s: a part that hangs or fails costs only its own share):
#   T  tests/kernels/test_sampling*.py, tests/kernels/test_grammars.py (a grammar row's mask on
#      CUDA) and tests/actors/executor, on CUDA where they can; then the engine on CUDA against
#      transformers: tests/engine/test_engine_triton.py, test_speculative_decoding.py
#   A  bench/host_cost.py --paths graph: the host's cost of a decode step, the trivial forward
#      captured into real CUDA graphs; batches 1 64 256, greedy and sampled (A5: --device-ms 5)
#   B  bench/random_model.py + bench/offline.py (shoal, decode steps, generate at batch 256) on
#      the SmolLM2-135M shape, then the Llama-3.1-8B shape's decode steps alone (built in the
#      background during C)
#   S  speculative decoding on CUDA (issue 35): one stream's decode on the SmolLM2 shape with
#      n-gram drafts and without (bench/offline.py --speculative-algorithm ngram)
#   C  py-spy over the decode windows of host_cost at batch 256, greedy: on-CPU samples
#      (pyspy.txt), then every thread's samples, idle too (pyspy_idle.txt); --threads, raw
# With a .before/ folder (an earlier commit's tree: `git archive REV | tar -x -C .before`,
# carried too), A runs on it as well, and B's SmolLM2 run (without generate) GPU_CHECK_ROUNDS
# (default 3) times on each tree, alternating, same card.
# Needs .whl/ (wheels for CPython 3.12 x86_64 the device lacks: msgspec 0.22.0, gguf 0.19.0,
# py-spy 0.4.3, pytest 9.2.0, pytest-asyncio 1.5.0, xgrammar 0.2.8 with apache-tvm-ffi
# 0.1.15.post2 and pydantic 2.14.4 (pydantic_core 2.50.5, annotated-types 0.8.0,
# typing-inspection 0.4.5, typing_extensions 4.16.0; the image has no pydantic): 11 MB
# together; each fetched with `pip download --no-deps
# --only-binary=:all: --python-version 3.12 --implementation cp --platform
# manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl NAME==VERSION`). Files in $OUT:
# gpu_check.log (all output), host_cost_gpu.jsonl, gpu_offline.jsonl (a {"shape": ..} line
# before each model's lines), pyspy.txt, pyspy_idle.txt. The summary is printed last.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
mkdir -p "$OUT"
exec </dev/null
LOG=$OUT/gpu_check.log
DRY=${GPU_CHECK_DRY:-0}
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
RESERVE=20 # seconds kept for the digests and the summary
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export SHOAL_CACHE_DIR=${SHOAL_CACHE_DIR:-/tmp/shoal-cache}
STATUS=()    # "part rc seconds"
BG_PIDS=()   # background processes still to stop on exit
trap 'for p in "${BG_PIDS[@]}"; do kill "$p" 2>/dev/null; done' EXIT

if [ "$DRY" = 1 ]; then
  SITE=/tmp/gpu_check_site PKG=/tmp/gpu_check_pkg MODELS=/tmp/gpu_check_models
  BUDGET=${GPU_CHECK_BUDGET_S:-1200}
  TAGS=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
        --platform manylinux1_x86_64)  # install for 3.12 only to check the wheels
  HC_BATCHES=(1 4) HC_STEPS=8 PROF_BATCH=8 PROF_STEPS=2000 PROF_S=3
  PROF_OFF=(--device cpu --requests 0 --peers --max-running 8 --kv-cache-tokens 4096
            --decode-batch 2 8 --decode-output-len 200)
  OFF=(--device cpu --max-running 8 --kv-cache-tokens 4096 --cuda-graph-max-batch 8
       --decode-batch 1 4 --decode-output-len 8 --prompt-len 8 16 --output-len 4 8
       --requests 8 --peers hf --hf-batch 8 --hf-solo 0)
  OFF_ALONE=(--device cpu --max-running 8 --kv-cache-tokens 4096 --cuda-graph-max-batch 8
              --decode-batch 1 4 --decode-output-len 8 --prompt-len 8 16 --output-len 4 8
              --requests 8 --peers)
  OFF_BIG=("${OFF_ALONE[@]}" --requests 0)
  SPEC=(--device cpu --requests 0 --peers --max-running 4 --kv-cache-tokens 4096
        --decode-batch 1 --decode-output-len 16)
  BIG_SHAPE=smollm2  # the 8B's commands, run on the small folder (reused, not rebuilt)
else
  SITE=/tmp/site PKG=/tmp/pkg MODELS=/tmp/models TAGS=()
  HC_BATCHES=(1 64 256) HC_STEPS=200 PROF_BATCH=256 PROF_STEPS=1500 PROF_S=10
  PROF_OFF=(--device cuda --requests 0 --peers --max-running 256 --kv-cache-tokens 270000
            --cuda-graph-max-batch 256 --decode-batch 64 256 --decode-output-len 1000)
  OFF=(--device cuda --max-running 256 --kv-cache-tokens 131072 --cuda-graph-max-batch 256
       --decode-batch 1 64 256 --decode-output-len 128 --requests 256
       --peers hf --hf-batch 256 --hf-solo 0)
  OFF_ALONE=(--device cuda --max-running 256 --kv-cache-tokens 131072 --cuda-graph-max-batch 256
              --decode-batch 1 64 256 --decode-output-len 128 --requests 256 --peers)
  OFF_BIG=(--device cuda --max-running 256 --kv-cache-tokens 131072 --cuda-graph-max-batch 256
           --decode-batch 1 64 256 --decode-output-len 128 --requests 0 --peers)
  SPEC=(--device cuda --requests 0 --peers --max-running 8 --kv-cache-tokens 16384
        --decode-batch 1 --decode-output-len 256)
  BIG_SHAPE=llama-8b
fi
# The 8B shape's 16 GB of weights: in /dev/shm (memory) when /tmp has less than 24 GB free.
if [ "$DRY" != 1 ] && (($(df -Pk /tmp | awk 'NR==2 {print $4}') < 24000000)) &&
  [ -d /dev/shm ]; then
  MODELS=/dev/shm/models
fi
BIG_DIR=$MODELS/$BIG_SHAPE

say() { echo "$*" | tee -a "$LOG"; }
left() { echo $((BUDGET - SECONDS - RESERVE)); }
record() { STATUS+=("$1 $2 $3"); say "=== $1: rc=$2 in $3s"; }

# part NAME MAX_S CMD...: CMD under timeout, at most MAX_S and what the deadline leaves.
# PART_SIGNAL (default TERM) is the first signal sent; KILL follows 10 s later.
part() {
  local name=$1 max=$2 t began rc
  shift 2
  t=$(left)
  ((t > max)) && t=$max
  if ((t < 15)); then
    say "=== $name: skipped, ${t}s left"
    STATUS+=("$name skipped 0")
    return 99
  fi
  say "=== $name (limit ${t}s): $*"
  began=$SECONDS
  timeout -s "${PART_SIGNAL:-TERM}" -k 10 "$t" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  record "$name" "$rc" $((SECONDS - began))
  return "$rc"
}

# ---- setup: wheels, the package as `shoal`, the machine -------------------------------------
say "=== setup $(date -u +%FT%TZ) dry=$DRY budget=${BUDGET}s out=$OUT"
mkdir -p "$PKG" "$MODELS"
ln -sfn "$PWD" "$PKG/shoal"
part wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target "$SITE" "${TAGS[@]}" .whl/*.whl
if [ "$DRY" = 1 ]; then export PYTHONPATH=$PKG; else export PYTHONPATH=$PKG:$SITE; fi
export PATH=$SITE/bin:$PATH
{ nvidia-smi -L && nvidia-smi --query-gpu=driver_version,memory.total,clocks.max.sm \
  --format=csv || echo "no nvidia-smi"; lscpu | grep -m1 'Model name' || true; nproc; free -g
  df -h /tmp /dev/shm; echo "models in $MODELS"; } 2>&1 |
  tee -a "$LOG"
part versions 90 "$PY" -c '
import importlib.metadata as md, shutil, sys, torch, triton, transformers, shoal
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
print("triton", triton.__version__, "transformers", transformers.__version__)
print("shoal from", shoal.__file__)
print("msgspec", md.version("msgspec"), "gguf", md.version("gguf"), "py-spy", shutil.which("py-spy"))
'

# ---- T: the tests whose CUDA paths run nowhere else (sampling on the device, the executor's
# per-row tensors, graphs fed on the device); the GGUF of tests/engine/test_cuda.py does not
# travel (98 MB), so the end-to-end runs below stand in for it -------------------------------
T_FILES=(tests/kernels/test_sampling.py tests/kernels/test_sampling_columns.py
         tests/kernels/test_grammars.py tests/actors/executor)
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 part T-tests 150 "$PY" -m pytest -q -x -p asyncio \
  -p no:cacheprovider "${T_FILES[@]}"

# The engine on CUDA (device auto) with the tiny model, against transformers' float32 tokens:
# the Triton backend, and speculative decoding's drafts through it (issue 35)
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 part T-engine 150 "$PY" -m pytest -q -p asyncio \
  -p no:cacheprovider tests/engine/test_engine_triton.py tests/engine/test_speculative_decoding.py

# ---- A: the host's cost of a decode step on CUDA graphs -------------------------------------
HC=(bench/host_cost.py --paths graph --batches "${HC_BATCHES[@]}" --steps "$HC_STEPS"
    --sampling greedy sampled --out "$OUT/host_cost_gpu.jsonl")
part A-host-cost 150 "$PY" "${HC[@]}"
A_RC=$?
# The same before this session's changes: the tree of the commit given as .before/ (carried;
# GPU_CHECK_BEFORE names it), imported as `shoal` from its own folder.
BEFORE_PKG=/tmp/pkg-before
before() {  # before CMD...: CMD in .before/, which it imports as `shoal`
  local saved=$PYTHONPATH rc
  pushd .before >/dev/null || return 1
  export PYTHONPATH=$BEFORE_PKG:${saved#*:}
  "$@"
  rc=$?
  export PYTHONPATH=$saved
  popd >/dev/null || true
  return "$rc"
}
if [ -d .before ]; then
  mkdir -p "$BEFORE_PKG" && ln -sfn "$PWD/.before" "$BEFORE_PKG/shoal"
  echo "{\"before\": \"${GPU_CHECK_BEFORE:-.before}\"}" >>"$OUT/host_cost_gpu.jsonl"
  before part A-host-cost-before 150 "$PY" bench/host_cost.py --paths graph \
    --batches "${HC_BATCHES[@]}" --steps "$HC_STEPS" --sampling greedy sampled \
    --out "$OUT/host_cost_gpu.jsonl"
fi

# ---- B: the SmolLM2 shape ------------------------------------------------------------------
offline() {  # offline SHAPE FOLDER MAX_S ARGS...
  local shape=$1 folder=$2 max=$3
  shift 3
  echo "{\"shape\": \"$shape\", \"folder\": \"$folder\", \"args\": \"$*\"}" >>"$OUT/gpu_offline.jsonl"
  part "B-offline-$shape" "$max" "$PY" bench/offline.py --model "$folder" "$@" \
    --out "$OUT/gpu_offline.jsonl"
}
if part B-build-smollm2 120 "$PY" bench/random_model.py smollm2 "$MODELS/smollm2"; then
  offline smollm2 "$MODELS/smollm2" 200 "${OFF[@]}"
  if [ -d .before ]; then  # the before tree, same card: shoal alone, no generate, alternating
    # with this tree's, GPU_CHECK_ROUNDS rounds (a fresh machine's first compiles Triton's)
    for ((round = 1; round <= ${GPU_CHECK_ROUNDS:-3}; round++)); do
      echo "{\"shape\": \"smollm2-after-$round\"}" >>"$OUT/gpu_offline.jsonl"
      part "B-offline-smollm2-after-$round" 60 "$PY" bench/offline.py \
        --model "$MODELS/smollm2" "${OFF_ALONE[@]}" --out "$OUT/gpu_offline.jsonl"
      echo "{\"shape\": \"smollm2-before-$round\"}" >>"$OUT/gpu_offline.jsonl"
      before part "B-offline-smollm2-before-$round" 60 "$PY" bench/offline.py \
        --model "$MODELS/smollm2" "${OFF_ALONE[@]}" --out "$OUT/gpu_offline.jsonl"
    done
  fi
  # S: one stream's decode with drafts (replayed by the decode graphs) and without
  offline smollm2-spec-on "$MODELS/smollm2" 90 "${SPEC[@]}" --speculative-algorithm ngram
  offline smollm2-spec-off "$MODELS/smollm2" 90 "${SPEC[@]}"
fi

# ---- the 8B shape's weights, built in the background while C runs -------------------------
say "=== B-build-$BIG_SHAPE (background): bench/random_model.py $BIG_SHAPE $BIG_DIR"
BUILD_BEGAN=$SECONDS
"$PY" bench/random_model.py "$BIG_SHAPE" "$BIG_DIR" >/tmp/gpu_check_build.log 2>&1 &
BUILD_PID=$!
BG_PIDS+=("$BUILD_PID")

# ---- C: py-spy over decode windows at batch PROF_BATCH --------------------------------------
# The target: host_cost (decode windows of PROF_STEPS steps, 8 of them), or where A failed
# (or GPU_CHECK_PROFILE=offline), offline.py's decode steps on the SmolLM2 shape. py-spy
# attaches once the target has printed its first window (its first, smaller decode batch).
if [ "${GPU_CHECK_PROFILE:-auto}" = offline ] || [ "$A_RC" != 0 ]; then
  TARGET=(bench/offline.py --model "$MODELS/smollm2" "${PROF_OFF[@]}") STEADY='^decode batch='
else
  TARGET=(bench/host_cost.py --paths graph --batches "$PROF_BATCH" --sampling greedy
          --steps "$PROF_STEPS" --repeat 8) STEADY='^host_cost path=graph'
fi
profile() {
  local t began=$SECONDS tlog=/tmp/gpu_check_target.log pid rc=1 i
  t=$(left)
  if ((t < 4 * PROF_S + 30)); then record C-pyspy skipped 0; return; fi
  say "=== C-pyspy: ${TARGET[*]}, then py-spy -d $PROF_S twice"
  "$PY" "${TARGET[@]}" >"$tlog" 2>&1 &
  pid=$!
  BG_PIDS+=("$pid")
  for ((i = 0; i < t - 2 * PROF_S - 20; i++)); do  # the first window ends: steady from here
    grep -q "$STEADY" "$tlog" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if grep -q "$STEADY" "$tlog" && kill -0 "$pid" 2>/dev/null; then
    say "attaching to $pid after $((SECONDS - began))s"
    timeout -s INT -k 5 $((PROF_S + 20)) py-spy record -p "$pid" -d "$PROF_S" -r 200 \
      --threads -f raw -o "$OUT/pyspy.txt" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    timeout -s INT -k 5 $((PROF_S + 20)) py-spy record -p "$pid" -d "$PROF_S" -r 200 \
      --threads --idle -f raw -o "$OUT/pyspy_idle.txt" 2>&1 | tee -a "$LOG"
  fi
  kill "$pid" 2>/dev/null
  sleep 2
  kill -9 "$pid" 2>/dev/null
  say "--- the profiled process's output:"
  tee -a "$LOG" <"$tlog"
  record C-pyspy "$rc" $((SECONDS - began))
  if [ "$rc" != 0 ] || [ ! -s "$OUT/pyspy.txt" ]; then  # attaching failed: run it under py-spy
    PART_SIGNAL=INT part C-pyspy-launched $((3 * PROF_S + 50)) py-spy record -r 200 --threads \
      -f raw -o "$OUT/pyspy.txt" -- "$PY" "${TARGET[@]}"
  fi
}
profile

# ---- the 8B build's end, A5, then the 8B shape ---------------------------------------------
while kill -0 "$BUILD_PID" 2>/dev/null && (($(left) > 60)); do sleep 1; done
if kill "$BUILD_PID" 2>/dev/null; then
  say "the build was stopped: no time left"
  sleep 5
  kill -9 "$BUILD_PID" 2>/dev/null
fi
wait "$BUILD_PID"
BUILD_RC=$?
tee -a "$LOG" </tmp/gpu_check_build.log
record "B-build-$BIG_SHAPE" "$BUILD_RC" $((SECONDS - BUILD_BEGAN))
part A5-host-cost 100 "$PY" "${HC[@]}" --device-ms 5
if [ "$BUILD_RC" = 0 ]; then offline "$BIG_SHAPE" "$BIG_DIR" 400 "${OFF_BIG[@]}"
else record "B-offline-$BIG_SHAPE" skipped 0; fi

# ---- digests and the summary (printed last) -------------------------------------------------
for f in "$OUT"/pyspy*.txt; do  # keep each file under the 16 MiB a file may bring back
  [ -f "$f" ] && (($(stat -c %s "$f") > 15000000)) && gzip -f "$f"
done
STATUS_TEXT=$(printf '%s\n' "${STATUS[@]}")
export STATUS_TEXT LOG OUT PROF_S
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import collections, json, os, re
out = os.environ["OUT"]

def lines(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]

def digest(name, seconds):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        print(f"{name}: none")
        return
    threads, leaves = collections.Counter(), collections.Counter()
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames, n = stack.split(";"), int(count)
        label = re.sub(r"^thread \((0x)?[0-9a-fA-F]+\): ", "", frames[0])
        threads[label] += n
        leaf = re.sub(r":\d+\)$", ")", frames[-1]) if len(frames) > 1 else f"[{label}: none]"
        leaves[leaf] += n
    total = sum(threads.values()) or 1
    print(f"{name}: {total} samples; per thread (share of {seconds} s at 200 Hz):")
    for label, n in threads.most_common(8):
        print(f"  {n / (200 * seconds):6.1%}  {label}")
    print("  top leaf frames (self):")
    for leaf, n in leaves.most_common(12):
        print(f"  {n / total:6.1%}  {leaf[:110]}")

seconds = float(os.environ["PROF_S"])
print("\n======== py-spy digest")
digest("pyspy.txt", seconds)
digest("pyspy_idle.txt", seconds)
print("\n======== SUMMARY")
print("part                      rc       seconds")
for row in os.environ["STATUS_TEXT"].splitlines():
    if row.strip():
        name, rc, s = row.split()
        print(f"{name:<25} {rc:<8} {s}")
log = open(os.environ["LOG"], errors="replace").read()
errors = collections.Counter(re.findall(r"^(\w[\w.]*(?:Error|Exception)\b.{0,100})", log, re.M))
for line, n in errors.most_common(6):
    print(f"error x{n}: {line}")
for needle in ("capturing CUDA graphs failed", "Traceback"):
    print(f"log lines with {needle!r}: {log.count(needle)}")
print("\nhost_cost (graph path): sampling dev_ms batch step_ms total/loop/launch/compl us_per_seq")
for d in lines("host_cost_gpu.jsonl"):
    if "before" in d:
        print(f"  -- before: {d['before']}")
    elif "batch" in d:
        print(f"  {d['sampling']:<8} {d['device_ms']:<4} {d['batch']:<4} {d['step_ms']:>8}"
              f"  {d['total_us_per_seq']}/{d['loop_us_per_seq']}/{d['launch_us_per_seq']}"
              f"/{d['completion_us_per_seq']} busy={d['device_busy']}")
    else:
        print(f"  fit {d['sampling']} dev_ms={d['device_ms']}: fixed_ms={d['fixed_ms']}"
              f" us_per_seq={d['us_per_seq']}")
print("\noffline:")
for d in lines("gpu_offline.jsonl"):
    if "shape" in d:
        print(f"  [{d['shape']}]")
    elif "system" in d:
        print(f"  {d['system']:<22} tok/s={d['tok_per_s']:<9} s={d['seconds']:<7}"
              f" setup_s={d['setup_s']} {d['setup']}")
    elif "batch" in d:
        spec = "".join(f" {k}={d[k]}" for k in ("spec_steps", "spec_accepted") if k in d)
        print(f"  decode b={d['batch']:<4} step_ms={d['step_ms']:<8} roofline_ms="
              f"{d['roofline_ms']:<8} fraction={d['fraction_of_roofline']} steps={d['steps']}"
              f"{spec}")
print("\nfiles:", ", ".join(f"{n} {os.path.getsize(os.path.join(out, n))}B"
                             for n in sorted(os.listdir(out))))
EOF

#!/bin/bash
# Runs INSIDE the arm64 root (deploy/arm64/test-userland.sh): starts the daemon with the phone's launcher, then
# checks health, the backend decision, a tiny training job, the adapter download and generation through the CLI.
# Prints one `PASS <check>` or `FAIL <check>: <why>` line per check. Sized for qemu-user on 2 shared cores.
set -uo pipefail

VENV=/opt/lorad/venv
PY="$VENV/bin/python"
LORAD="$VENV/bin/lorad"
WORK=/root/e2e
DATA="$WORK/data"
START_TIMEOUT="${LORAD_E2E_START_SECONDS:-300}" # torch + onnxruntime imports under emulation take minutes
TRAIN_TIMEOUT="${LORAD_E2E_TRAIN_SECONDS:-420}"

ok() { printf 'PASS %s\n' "$1"; }
bad() { printf 'FAIL %s: %s\n' "$1" "$2"; }
t() { printf '[e2e %(%H:%M:%S)T] %s\n' -1 "$*"; }
# jq-like field access with the venv's Python: jget FILE EXPR (EXPR over `d`, the parsed JSON).
jget() { "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"; }

rm -rf "$WORK"
mkdir -p "$WORK"
# The device probe reads a JSON file (as the tests and the demo do): on a charger, cool, idle.
echo '{"battery_percent": 90, "charging": true, "temperature_celsius": 30.0, "idle": true}' > "$WORK/probe.json"
# The installed config (install.sh --services-only) stays; the test's settings come in as LORAD_* overrides.
export LORAD_STORAGE_DATA_DIR="$DATA"
export LORAD_CONDITIONS_PROBE=file LORAD_CONDITIONS_PROBE_FILE="$WORK/probe.json" LORAD_CONDITIONS_POLL_SECONDS=1
export LORAD_TRAINING_DEFAULT_MODEL=/root/tiny-llama LORAD_TRAINING_TORCH_THREADS=2 LORAD_LOGGING_FORMAT=json
export LORAD_STATE_DIR="$WORK/state"
SOCK="$DATA/run/lorad.sock"

t "starting the daemon with /opt/lorad/bin/lorad-inproot"
/opt/lorad/bin/lorad-inproot > "$WORK/daemon.log" 2>&1 &
DAEMON=$!
stop_daemon() {
    if kill -0 "$DAEMON" 2> /dev/null; then
        kill -TERM "$DAEMON"
        for _ in $(seq 60); do kill -0 "$DAEMON" 2> /dev/null || break; sleep 1; done
        kill -KILL "$DAEMON" 2> /dev/null || true
    fi
}
trap stop_daemon EXIT

t0=$SECONDS
while [ ! -S "$SOCK" ] && kill -0 "$DAEMON" 2> /dev/null && [ $((SECONDS - t0)) -lt "$START_TIMEOUT" ]; do sleep 2; done
if [ -S "$SOCK" ]; then
    ok "serve-starts (socket after $((SECONDS - t0)) s)"
else
    bad serve-starts "no socket at $SOCK after $((SECONDS - t0)) s; daemon log tail:"
    tail -20 "$WORK/daemon.log"
    exit 1
fi
if [ "$(cat "$WORK/state/lorad.pid" 2> /dev/null)" = "$DAEMON" ]; then ok inproot-pidfile; else
    bad inproot-pidfile "lorad-inproot did not record the daemon's pid"
fi

health=$("$PY" - "$SOCK" << 'EOF'
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel("unix:" + sys.argv[1]) as ch:
    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
print(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))
EOF
)
if [ "$health" = SERVING ]; then ok health; else bad health "grpc.health.v1 answered '$health'"; fi

t "register an app, add data, train"
if "$LORAD" app register e2e --json > "$WORK/app.json"; then
    LORAD_TOKEN=$(jget "$WORK/app.json" 'd["token"]')
    export LORAD_TOKEN
    ok app-register
else
    bad app-register "lorad app register failed"
    exit 1
fi
t "lorad status"
if timeout 120 "$LORAD" status > "$WORK/status.txt" 2>&1 && timeout 120 "$LORAD" status --json > "$WORK/status.json"; then
    cat "$WORK/status.txt"
    backend=$(jget "$WORK/status.json" 'd["backend"]["backend"]')
    reason=$(jget "$WORK/status.json" 'd["backend"]["reason"]')
    qnn=$(jget "$WORK/status.json" '[a for a in d["backend"]["available"] if a["backend"] == "qnn-htp"]')
    # Without a reachable DSP the decision is a CPU backend: torch when the CPU has bf16 (BFMMLA; qemu's max model
    # and a recent phone core do), ORT's CPU EP otherwise. Either way the reason says why the NPU is not used.
    if { [ "$backend" = torch ] || [ "$backend" = ort-cpu ]; } && [[ "$reason" == "no NPU"* || "$reason" == *"QNN HTP"* ]]; then
        ok "status-backend ($backend: $reason)"
    else
        bad status-backend "backend=$backend reason=$reason"
    fi
    case "$qnn" in
        *"'usable': False"*) ok "status-qnn-unusable ($qnn)" ;;
        *) bad status-qnn-unusable "qnn-htp entry: $qnn" ;;
    esac
else
    bad status "lorad status failed: $(tail -3 "$WORK/status.txt")"
fi

for i in $(seq 12); do
    printf '{"text": "Tofu is a grey whippet who likes walks number %s in the park."}\n' "$i"
done > "$WORK/samples.jsonl"
if "$LORAD" data add diary "$WORK/samples.jsonl" > "$WORK/data.txt" 2>&1; then ok data-add; else
    bad data-add "$(tail -3 "$WORK/data.txt")"
fi

# train_job LABEL BACKEND EXPECTED: a 3-step job (seq 32, rank 4) to SUCCEEDED; prints its id on fd 3 and checks that it ran
# on EXPECTED (the daemon's decision for auto, else the backend asked for).
train_job() {
    local label=$1 want=$2 expected=$3 t1=$SECONDS rc job state jbackend loss
    timeout "$TRAIN_TIMEOUT" "$LORAD" train diary --steps 3 --seq-len 32 --batch-size 1 --rank 4 --eval-every 3 \
        --backend "$want" --json > "$WORK/train-$label.json" 2> "$WORK/train-$label.err"
    rc=$?
    job=$(jget "$WORK/train-$label.json" 'd["job_id"]' 2> /dev/null)
    if [ "$rc" -eq 0 ] && [ -n "$job" ]; then ok "train-$label-create ($job, --backend $want)"; else
        bad "train-$label-create" "exit $rc: $(tail -3 "$WORK/train-$label.err")"
        return 1
    fi
    timeout "$TRAIN_TIMEOUT" "$LORAD" watch "$job" > "$WORK/watch-$label.txt" 2>&1
    rc=$?
    "$LORAD" jobs show "$job" --json > "$WORK/job-$label.json" 2> /dev/null
    state=$(jget "$WORK/job-$label.json" 'd["job"]["state"]' 2> /dev/null)
    jbackend=$(jget "$WORK/job-$label.json" 'd["job"]["backend"]' 2> /dev/null)
    loss=$(jget "$WORK/job-$label.json" 'd["job"]["progress"]["train_loss"]' 2> /dev/null)
    if [ "$rc" -eq 0 ] && [ "$state" = succeeded ]; then
        ok "train-$label-succeeded ($((SECONDS - t1)) s, backend $jbackend, train loss $loss)"
    else
        bad "train-$label-succeeded" "watch exit $rc, state '$state'; $(tail -3 "$WORK/watch-$label.txt")"
        jget "$WORK/job-$label.json" 'd["job"]["error"]' 2> /dev/null
    fi
    if [ "$jbackend" = "$expected" ]; then ok "train-$label-backend ($jbackend)"; else
        bad "train-$label-backend" "job ran on '$jbackend', expected '$expected'"
    fi
    echo "$job" >&3
}

exec 4>&1 # train_job's output stays on stdout (fd 4) while fd 3 carries the job id into $job
job=$(train_job auto auto "${backend:-?}" 3>&1 1>&4)
[ -n "$job" ] || exit 1
# ORT's CPU EP on aarch64 is the other CPU engine (and the one qemu 7.2 crashed in): train on it explicitly too.
if [ "${backend:-}" != ort-cpu ]; then
    t "train again on ort-cpu"
    train_job ort ort-cpu ort-cpu 3> /dev/null
fi

t "pull the adapter"
mkdir -p "$WORK/out"
if "$LORAD" adapters pull "$job" -o "$WORK/out/adapter.tar" > "$WORK/pull.txt" 2>&1 \
    && tar -tf "$WORK/out/adapter.tar" | grep -q 'adapter_model.safetensors'; then
    ok "adapter-pull-verified ($(stat -c %s "$WORK/out/adapter.tar") bytes)"
else
    bad adapter-pull-verified "$(tail -3 "$WORK/pull.txt")"
fi

t "generate with the adapter"
# The tiny random model's tokens may decode to whitespace only: check the token count, not the text.
if timeout 300 "$LORAD" generate "Who is Tofu?" --adapter "$job" --max-tokens 8 --json > "$WORK/gen.json" 2>&1 \
    && [ "$(jget "$WORK/gen.json" 'd["token_count"]')" -gt 0 ]; then
    ok "generate ($(jget "$WORK/gen.json" 'd["token_count"], d["finish_reason"], repr(d["text"][:40])' | tr '\n' ' '))"
else
    bad generate "$(tail -3 "$WORK/gen.json")"
fi

t "stop the daemon (SIGTERM)"
kill -TERM "$DAEMON"
for _ in $(seq 60); do kill -0 "$DAEMON" 2> /dev/null || break; sleep 1; done
if kill -0 "$DAEMON" 2> /dev/null; then bad daemon-stops "still running 60 s after SIGTERM"; else ok daemon-stops; fi

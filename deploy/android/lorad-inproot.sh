#!/bin/sh
# Runs inside the proot userland: record the daemon's pid (a real pid: proot does not virtualise pids), then
# exec `lorad serve` so runit's control/t script can deliver SIGTERM to the daemon itself (graceful checkpoint).
set -eu

STATE_DIR="${LORAD_STATE_DIR:-/root/.local/state/lorad}"
CONFIG="${LORAD_CONFIG:-/root/.config/lorad/lorad.toml}"
VENV="${LORAD_VENV:-/opt/lorad/venv}"

mkdir -p "$STATE_DIR"
chmod 0700 "$STATE_DIR"
# A daemon killed while training leaves the wake-lock request set; clear it before anything else runs.
/opt/lorad/bin/lorad-wakelock release || true
echo "$$" > "$STATE_DIR/lorad.pid"
export LORAD_CONFIG="$CONFIG"
exec "$VENV/bin/lorad" serve --config "$CONFIG"

#!/bin/sh
# Wake-lock hook for the lorad daemon: `lorad-wakelock acquire` when a job starts training, `release` when it stops.
#
# The daemon runs inside proot, where Termux's `am`-based termux-wake-lock cannot reach the Termux app reliably.
# So by default this hook only records the request in a state file; the Termux-side runit service
# `lorad-wakelock` watches that file and calls termux-wake-lock / termux-wake-unlock on each change.
# LORAD_WAKELOCK_MODE=direct calls termux-wake-lock / termux-wake-unlock directly (daemon running in Termux itself).
set -eu

STATE_DIR="${LORAD_STATE_DIR:-/root/.local/state/lorad}"
MODE="${LORAD_WAKELOCK_MODE:-file}"
ACTION="${1:-}"

case "$ACTION" in
    acquire) want=held ;;
    release) want=released ;;
    status)
        cat "$STATE_DIR/wakelock" 2> /dev/null || echo released
        exit 0
        ;;
    *)
        echo "usage: lorad-wakelock acquire|release|status" >&2
        exit 2
        ;;
esac

if [ "$MODE" = direct ]; then
    if [ "$want" = held ]; then cmd=termux-wake-lock; else cmd=termux-wake-unlock; fi
    # termux-* commands go through the Termux app and can hang when it is not running: bound the wait (seconds).
    exec timeout 10 "$cmd"
fi

mkdir -p "$STATE_DIR"
# temp file + rename: the watcher never reads a half-written state.
tmp="$STATE_DIR/.wakelock.$$"
echo "$want" > "$tmp"
mv -f "$tmp" "$STATE_DIR/wakelock"

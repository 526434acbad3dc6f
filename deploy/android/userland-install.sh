#!/bin/sh
# The in-userland half of the Android install: runs as root INSIDE the glibc userland (proot-distro on the phone,
# an arm64 chroot in deploy/arm64/test-userland.sh), so the phone and the arm64 test run this same file.
#
# Idempotent: python3-venv and the venv are installed once; pip re-runs only upgrade what changed.
#
# Environment (all optional; install.sh passes its own values through):
#   LORAD_SPEC         pip requirement for lorad, default "lorad[server]"; a path or wheel works too
#   LORAD_QNN_SPEC     onnxruntime-qnn requirement, default "onnxruntime-qnn" (manylinux_2_34 aarch64 wheel)
#   LORAD_TORCH        a torch requirement to install first, default empty: lorad's own pin decides (see
#                      pyproject.toml: torch==2.10.0 on aarch64, whose PyPI wheel is CPU-only)
#   LORAD_TORCH_INDEX  index for LORAD_TORCH only, default empty (PyPI)
#   LORAD_VENV         the venv, default /opt/lorad/venv
set -eu

LORAD_SPEC="${LORAD_SPEC:-lorad[server]}"
LORAD_QNN_SPEC="${LORAD_QNN_SPEC:-onnxruntime-qnn}"
LORAD_TORCH="${LORAD_TORCH:-}"
LORAD_TORCH_INDEX="${LORAD_TORCH_INDEX:-}"
VENV="${LORAD_VENV:-/opt/lorad/venv}"

say() { printf '[lorad-install] %s\n' "$*"; }
die() {
    printf '[lorad-install] ERROR: %s\n' "$*" >&2
    exit 1
}

system_packages() {
    if [ -x "$VENV/bin/python" ]; then
        say "venv $VENV already exists"
        return 0
    fi
    say "installing python3-venv"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates
    python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
        || die "this userland has Python < 3.11; lorad needs 3.11+ (use debian bookworm+ or ubuntu 24.04+)"
    python3 -m venv "$VENV"
}

python_packages() {
    "$VENV/bin/pip" install --upgrade pip
    if [ -n "$LORAD_TORCH" ]; then
        say "installing $LORAD_TORCH first"
        if [ -n "$LORAD_TORCH_INDEX" ]; then
            "$VENV/bin/pip" install "$LORAD_TORCH" --index-url "$LORAD_TORCH_INDEX"
        else
            "$VENV/bin/pip" install "$LORAD_TORCH"
        fi
    fi
    say "installing $LORAD_SPEC and $LORAD_QNN_SPEC"
    # shellcheck disable=SC2086 # LORAD_TORCH is one requirement or nothing
    "$VENV/bin/pip" install $LORAD_TORCH "$LORAD_SPEC" "$LORAD_QNN_SPEC"
}

report() {
    # The wheel carries one HTP skel per Hexagon generation; list what this install can drive.
    "$VENV/bin/python" - << 'EOF'
import pathlib, onnxruntime_qnn as oq
libdir = pathlib.Path(oq.get_qnn_htp_path()).parent
skels = sorted(p.name for p in libdir.glob("libQnnHtpV*Skel.so"))
print("[lorad-install] HTP skels in the onnxruntime-qnn wheel:", ", ".join(skels) or "NONE")
EOF
}

system_packages
python_packages
report
say "userland install done"

#!/data/data/com.termux/files/usr/bin/bash
# Install lorad on Android: Termux + a proot-distro glibc userland (aarch64), termux-services, Termux:Boot.
#
# Why a userland: Termux's own Python links against Bionic and cannot load manylinux wheels (torch,
# onnxruntime, onnxruntime-qnn). Inside proot-distro Debian/Ubuntu, pip installs them unchanged.
#
# Idempotent: every step checks what is already there and skips it; re-run to upgrade lorad.
#
# Environment (all optional):
#   LORAD_DISTRO       proot-distro alias, "debian" (default) or "ubuntu"
#   LORAD_SPEC, LORAD_QNN_SPEC, LORAD_TORCH, LORAD_TORCH_INDEX
#                      passed to the in-userland half, userland-install.sh (see its header for the defaults)
#   LORAD_NO_SERVICE   set to 1 to skip installing the runit services and the Termux:Boot script
#
# `install.sh --services-only` installs only the helper scripts, config, services and boot script into an existing
# userland (after editing them, or to test the layout under a temporary PREFIX and HOME).
set -euo pipefail

DISTRO="${LORAD_DISTRO:-debian}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX="${PREFIX:-/data/data/com.termux/files/usr}"
ROOTFS="$PREFIX/var/lib/proot-distro/installed-rootfs/$DISTRO"
VENV=/opt/lorad/venv   # path inside the userland

say() { printf '[lorad-install] %s\n' "$*"; }
die() { printf '[lorad-install] ERROR: %s\n' "$*" >&2; exit 1; }

in_distro() {
    # Run a command as root inside the userland (proot fakes root; no real privileges are gained).
    proot-distro login "$DISTRO" --shared-tmp -- /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$@"
}

check_host() {
    case "$PREFIX" in
        */com.termux/*) ;;
        *) die "run this inside the Termux app (PREFIX=$PREFIX is not a Termux prefix)" ;;
    esac
    [ "$(uname -m)" = "aarch64" ] || die "lorad's Android path needs an aarch64 device, this is $(uname -m)"
    case "$DISTRO" in
        debian | ubuntu) ;;
        *) die "LORAD_DISTRO=$DISTRO is not supported; use debian or ubuntu" ;;
    esac
}

termux_packages() {
    local need=()
    command -v proot-distro > /dev/null || need+=(proot-distro)
    command -v sv > /dev/null || need+=(termux-services)
    command -v termux-battery-status > /dev/null || need+=(termux-api)
    if [ "${#need[@]}" -gt 0 ]; then
        say "installing Termux packages: ${need[*]}"
        pkg install -y "${need[@]}"
    else
        say "Termux packages already present"
    fi
}

userland() {
    if [ -d "$ROOTFS/usr" ]; then
        say "proot-distro $DISTRO already installed"
    else
        say "installing proot-distro $DISTRO (a few hundred MB)"
        proot-distro install "$DISTRO"
    fi
    # The steps inside the userland live in one script that deploy/arm64/test-userland.sh runs too.
    install -d "$ROOTFS/opt/lorad/bin"
    install -m 0755 "$HERE/userland-install.sh" "$ROOTFS/opt/lorad/bin/lorad-userland-install"
    in_distro LORAD_SPEC="${LORAD_SPEC:-}" LORAD_QNN_SPEC="${LORAD_QNN_SPEC:-}" LORAD_TORCH="${LORAD_TORCH:-}" \
        LORAD_TORCH_INDEX="${LORAD_TORCH_INDEX:-}" /opt/lorad/bin/lorad-userland-install
}

helpers() {
    say "installing helper scripts into the userland"
    install -d "$ROOTFS/opt/lorad/bin"
    install -m 0755 "$HERE/lorad-inproot.sh" "$ROOTFS/opt/lorad/bin/lorad-inproot"
    install -m 0755 "$HERE/lorad-wakelock.sh" "$ROOTFS/opt/lorad/bin/lorad-wakelock"
    local cfg="$ROOTFS/root/.config/lorad/lorad.toml"
    if [ ! -f "$cfg" ]; then
        install -d "$(dirname "$cfg")"
        if [ -f "$HERE/../lorad.example.toml" ]; then
            cp "$HERE/../lorad.example.toml" "$cfg"
        else
            : > "$cfg"
        fi
        cat >> "$cfg" << 'EOF'

# Added by deploy/android/install.sh: hold the Termux wake lock only while a job trains.
[device]
profile = "phone"
wake_lock_acquire = "/opt/lorad/bin/lorad-wakelock acquire"
wake_lock_release = "/opt/lorad/bin/lorad-wakelock release"
EOF
        say "wrote $cfg"
    else
        say "keeping existing $cfg"
    fi
}

services() {
    local svdir="$PREFIX/var/service"
    for name in lorad lorad-wakelock; do
        say "installing runit service $name"
        install -d "$svdir/$name/log" "$PREFIX/var/log/sv/$name"
        install -m 0755 "$HERE/service/$name/run" "$svdir/$name/run"
        install -m 0755 "$HERE/service/$name/log/run" "$svdir/$name/log/run"
        if [ -d "$HERE/service/$name/control" ]; then
            install -d "$svdir/$name/control"
            install -m 0755 "$HERE/service/$name/control/"* "$svdir/$name/control/"
        fi
        # Record the distro so the run scripts do not need the environment of this shell.
        printf '%s\n' "$DISTRO" > "$svdir/$name/distro"
    done
    install -d "$HOME/.termux/boot"
    install -m 0755 "$HERE/boot/start-lorad" "$HOME/.termux/boot/start-lorad"
    say "installed ~/.termux/boot/start-lorad (needs the Termux:Boot app, opened once)"
    if command -v sv-enable > /dev/null && [ -n "${SVDIR:-}" ]; then
        sv-enable lorad-wakelock || true
        sv-enable lorad || true
    else
        say "restart Termux once so termux-services starts runsvdir, then: sv-enable lorad-wakelock; sv-enable lorad"
    fi
}

main() {
    if [ "${1:-}" = "--services-only" ]; then
        [ -d "$ROOTFS" ] || die "no userland at $ROOTFS; run install.sh without --services-only first"
        helpers
        services
        return 0
    fi
    check_host
    termux_packages
    userland
    helpers
    if [ "${LORAD_NO_SERVICE:-0}" != "1" ]; then
        services
    fi
    say "done. Check the backend with:"
    say "  proot-distro login $DISTRO -- $VENV/bin/python -c 'import lorad.kernels as k; print(k.detect_backend())'"
    say "See deploy/android/README.md for battery-optimization and phantom-process settings."
}

main "$@"

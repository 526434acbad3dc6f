#!/usr/bin/env bash
# End-to-end test of lorad in the phone's userland: an arm64 Debian root run under qemu-user on an x86_64 host.
#
# It builds (or reuses) a cached arm64 Debian root, runs the same in-userland install script the Android installer
# runs (deploy/android/userland-install.sh) and the installer's --services-only step, then inside the root starts
# the daemon through the phone's own launcher (lorad-inproot), checks health and the backend decision, trains a tiny
# model to SUCCEEDED, pulls and verifies the adapter, generates, and checks ORT's ARM64 bf16 fast-math option.
# Ends with one line: `test-arm64: N passed, M failed`. Needs root (chroot, mounts) and Debian's apt.
#
# Environment (all optional):
#   LORAD_ARM64_CACHE   cache for the root, pip downloads and the tiny model, default /var/cache/lorad-arm64
#   LORAD_ARM64_SUITE   Debian suite of the root, default trixie (what proot-distro's debian installs)
#   LORAD_ARM64_MIRROR  Debian mirror, default http://deb.debian.org/debian
#   LORAD_ARM64_HOST_CA CA bundle pip uses inside the root, default the host's /etc/ssl/certs/ca-certificates.crt
#   LORAD_HOST_PYTHON   host Python with lorad's dev extra (builds the wheel and the tiny model), default .venv
#   LORAD_ARM64_QEMU_SUITE  Debian suite whose static qemu-aarch64 runs the root, default trixie (qemu 10.0)
#   LORAD_ARM64_QEMU_CPU    qemu's CPU model (QEMU_CPU), default max,sve=off,sme=off
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${LORAD_ARM64_CACHE:-/var/cache/lorad-arm64}"
SUITE="${LORAD_ARM64_SUITE:-trixie}"
MIRROR="${LORAD_ARM64_MIRROR:-http://deb.debian.org/debian}"
HOST_PY="${LORAD_HOST_PYTHON:-$REPO/.venv/bin/python}"
ROOT="$CACHE/root-$SUITE"
DIST="$CACHE/dist"
# qemu-user's CPU model (read by qemu from QEMU_CPU in every emulated process): max has BF16/I8MM/dotprod like a
# recent phone core; SVE and SME are off because numpy's OpenBLAS SVE kernels give wrong products under qemu 10
# (see deploy/README.md).
QEMU_CPU_MODEL="${LORAD_ARM64_QEMU_CPU:-max,sve=off,sme=off}"
# qemu-user comes from this Debian suite, fetched into the cache: bookworm's qemu 7.2 segfaults in ORT and torch.
QEMU_SUITE="${LORAD_ARM64_QEMU_SUITE:-trixie}"
QEMU_DIR="$CACHE/qemu-$QEMU_SUITE"
QEMU_BIN="$QEMU_DIR/qemu-aarch64"
# The binfmt_misc entry's name: mmdebstrap looks for exactly this one to learn that the F flag is set.
BINFMT=/proc/sys/fs/binfmt_misc/qemu-aarch64
HOST_CA="${LORAD_ARM64_HOST_CA:-/etc/ssl/certs/ca-certificates.crt}"
PATH_IN_ROOT=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

say() { printf '[test-arm64] %s\n' "$*"; }
die() {
    printf '[test-arm64] ERROR: %s\n' "$*" >&2
    exit 1
}

# Runs "$@" as root inside the arm64 root, in its own mount and pid namespace: every process it starts (the daemon
# too) dies with it, and no mount outlives it. The pip cache and the lorad wheel are bind-mounted from the cache.
in_root() {
    # The host stage registers the cached qemu and the run's end restores the host's entry: a stage run on its own
    # (--stage e2e, --in-root) after that would silently get the host's qemu.
    grep -qx "interpreter $QEMU_BIN" "$BINFMT" 2> /dev/null \
        || die "binfmt qemu-aarch64 does not run $QEMU_BIN; run \`$0 --stage host\` first"
    unshare --mount --pid --fork --kill-child=SIGKILL -- "$0" --enter "$@"
}

enter() {
    mount --make-rprivate /
    mount -t proc proc "$ROOT/proc"
    mount --rbind /dev "$ROOT/dev"
    # proot-distro binds /sys too; without it cpuinfo (torch, onnxruntime) cannot count the cores.
    mount -t sysfs -o ro sysfs "$ROOT/sys"
    mkdir -p "$CACHE/pip" "$ROOT/root/.cache/pip" "$ROOT/tmp/lorad-dist"
    mount --bind "$CACHE/pip" "$ROOT/root/.cache/pip"
    mount --bind "$DIST" "$ROOT/tmp/lorad-dist"
    cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
    # The host may reach PyPI through a TLS-inspecting proxy whose CA only the host trusts: hand pip its bundle.
    cp "$HOST_CA" "$ROOT/etc/lorad-host-ca.crt"
    exec chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb PATH="$PATH_IN_ROOT" \
        PIP_CERT=/etc/lorad-host-ca.crt SSL_CERT_FILE=/etc/lorad-host-ca.crt QEMU_CPU="$QEMU_CPU_MODEL" "$@"
}

# --- stages (each runs as `test-userland.sh --stage NAME` under its own timeout) ---

# Downloads qemu-user from $QEMU_SUITE with a private apt configuration (the host's sources stay untouched) and keeps
# its static qemu-aarch64 in the cache.
fetch_qemu() {
    if [ -x "$QEMU_BIN" ] && [ -f "$QEMU_DIR/.ok" ]; then
        return 0
    fi
    local apt="$QEMU_DIR/apt"
    rm -rf "$QEMU_DIR"
    mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/deb"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR $QEMU_SUITE main" > "$apt/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/nonexistent
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o APT::Architecture=amd64
        -o Debug::NoLocking=1 -o APT::Sandbox::User=root)
    say "fetching qemu-user from Debian $QEMU_SUITE (private apt lists in $apt)"
    apt-get "${opts[@]}" -qq update
    (cd "$apt/deb" && apt-get "${opts[@]}" -qq download qemu-user)
    dpkg-deb -x "$apt"/deb/qemu-user_*.deb "$apt/x"
    install -m 0755 "$apt/x/usr/bin/qemu-aarch64" "$QEMU_BIN"
    file -L "$QEMU_BIN" | grep -q 'static' || die "$QEMU_BIN is not statically linked (needed with the F flag)"
    rm -rf "$apt/x" "$apt/cache" "$apt/lists"
    touch "$QEMU_DIR/.ok"
}

stage_host() {
    [ "$(id -u)" = 0 ] || die "needs root (chroot and mounts)"
    [ "$(uname -m)" = x86_64 ] || say "host is $(uname -m), not x86_64: continuing"
    local need=()
    command -v mmdebstrap > /dev/null || need+=(mmdebstrap)
    command -v arch-test > /dev/null || need+=(arch-test)
    command -v file > /dev/null || need+=(file)
    if [ "${#need[@]}" -gt 0 ]; then
        say "installing ${need[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
    fi
    fetch_qemu
    say "qemu: $("$QEMU_BIN" --version | head -1)"
    # Containers often start without binfmt_misc mounted: mount it.
    if [ ! -e /proc/sys/fs/binfmt_misc/register ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
            || die "cannot mount binfmt_misc (tried: mount -t binfmt_misc); this kernel/container blocks it"
    fi
    # Register the cached qemu for aarch64 ELF with the F flag (the kernel opens it now, so the chroot needs no copy)
    # and P (argv[0] kept). A host entry of the same name (Debian's qemu-user-static) is replaced for the run and
    # put back at its end (restore_binfmt).
    if [ -e "$BINFMT" ] && ! grep -qx "interpreter $QEMU_BIN" "$BINFMT"; then
        echo -1 > "$BINFMT"
    fi
    if [ ! -e "$BINFMT" ]; then
        local magic='\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00'
        local mask='\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff'
        printf ':qemu-aarch64:M::%s:%s:%s:FP\n' "$magic" "$mask" "$QEMU_BIN" > /proc/sys/fs/binfmt_misc/register \
            || die "cannot register $QEMU_BIN in binfmt_misc"
    fi
    grep -qx enabled "$BINFMT" || echo 1 > "$BINFMT"
    say "binfmt: $(tr '\n' ' ' < "$BINFMT")"
}

# Puts the host's own qemu-aarch64 binfmt entry back (Debian's update-binfmts), if the host has one.
restore_binfmt() {
    if [ -e "$BINFMT" ] && grep -qx "interpreter $QEMU_BIN" "$BINFMT"; then
        echo -1 > "$BINFMT" || true
        if [ -e /usr/share/binfmts/qemu-aarch64 ] && command -v update-binfmts > /dev/null; then
            update-binfmts --enable qemu-aarch64 > /dev/null 2>&1 || true
        fi
    fi
}

stage_root() {
    if [ -f "$ROOT/.lorad-root-ok" ]; then
        say "reusing $ROOT"
        check_emulator
        return 0
    fi
    rm -rf "$ROOT.tmp"
    say "building an arm64 Debian $SUITE root (minbase, like proot-distro's) in $ROOT"
    nice -n 10 mmdebstrap --arch=arm64 --variant=minbase "$SUITE" "$ROOT.tmp" "$MIRROR"
    rm -rf "$ROOT"
    mv "$ROOT.tmp" "$ROOT"
    touch "$ROOT/.lorad-root-ok"
    check_emulator
}

# Fails unless the root's programs run under the cached qemu (another binfmt entry could match aarch64 ELF first).
check_emulator() {
    chroot "$ROOT" /bin/sleep 5 &
    local pid=$! exe=""
    for _ in $(seq 50); do
        exe=$(readlink "/proc/$pid/exe" || true)
        [ "$exe" = "$QEMU_BIN" ] && break
        sleep 0.1
    done
    kill "$pid" 2> /dev/null || true
    wait "$pid" 2> /dev/null || true
    [ "$exe" = "$QEMU_BIN" ] || die "arm64 programs run under '$exe', not $QEMU_BIN"
    say "arm64 programs run under $QEMU_BIN, QEMU_CPU=$QEMU_CPU_MODEL"
}

stage_wheel() {
    [ -x "$HOST_PY" ] || die "no host Python at $HOST_PY (run make setup, or set LORAD_HOST_PYTHON)"
    rm -rf "$DIST"
    mkdir -p "$DIST"
    # lorad itself comes from this checkout (it is not on the registry); every dependency comes from PyPI.
    # Built from a copy of the tracked files: setuptools' build/ in the checkout can hold modules that were removed.
    local src="$CACHE/src"
    rm -rf "$src"
    mkdir -p "$src"
    git -C "$REPO" ls-files -z | tar -C "$REPO" --null -T - -cf - | tar -C "$src" -xf -
    (cd "$src" && "$HOST_PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DIST" .)
    ls "$DIST"/lorad-*.whl > /dev/null
}

stage_install() {
    # A lorad wheel of the same version would count as installed: drop the old one so this checkout's is tested.
    if [ -x "$ROOT/opt/lorad/venv/bin/pip" ]; then
        in_root /opt/lorad/venv/bin/pip uninstall --yes --quiet lorad || true
    fi
    install -d "$ROOT/opt/lorad/bin"
    install -m 0755 "$REPO/deploy/android/userland-install.sh" "$ROOT/opt/lorad/bin/lorad-userland-install"
    local whl
    whl="$(basename "$(ls "$DIST"/lorad-*.whl)")"
    nice -n 10 "$0" --in-root LORAD_SPEC="/tmp/lorad-dist/${whl}[server]" /opt/lorad/bin/lorad-userland-install
}

stage_services() {
    # install.sh --services-only writes into $PREFIX/var/lib/proot-distro/installed-rootfs/<distro>: point that at
    # the root, so its helper scripts and config land where lorad-inproot looks for them.
    local prefix="$CACHE/termux/usr" home="$CACHE/termux/home"
    mkdir -p "$prefix/var/lib/proot-distro/installed-rootfs" "$home"
    ln -sfn "$ROOT" "$prefix/var/lib/proot-distro/installed-rootfs/debian"
    PREFIX="$prefix" HOME="$home" LORAD_DISTRO=debian bash "$REPO/deploy/android/install.sh" --services-only
}

stage_model() {
    local model="$CACHE/tiny-llama"
    if [ ! -f "$model/.ok" ]; then
        rm -rf "$model" "$CACHE/tiny-build"
        mkdir -p "$CACHE/tiny-build"
        # A 2-layer random Llama (hidden 64, vocab 320) from the tests' own builder; the files are arch-independent.
        (cd "$REPO" && "$HOST_PY" -c \
            "import sys; from pathlib import Path; from tests.fixtures.tiny_hf import save_tiny_hf; \
             print(save_tiny_hf(Path(sys.argv[1]), 'llama'))" "$CACHE/tiny-build")
        mv "$CACHE/tiny-build/llama" "$model"
        touch "$model/.ok"
    fi
    rm -rf "$ROOT/root/tiny-llama"
    cp -r "$model" "$ROOT/root/tiny-llama"
}

stage_e2e() {
    install -m 0755 "$HERE/e2e-inroot.sh" "$ROOT/opt/lorad/bin/lorad-e2e"
    nice -n 10 "$0" --in-root /opt/lorad/bin/lorad-e2e
}

stage_bf16() {
    install -m 0644 "$HERE/ort_bf16_check.py" "$ROOT/tmp/ort_bf16_check.py"
    nice -n 10 "$0" --in-root /opt/lorad/venv/bin/python -u /tmp/ort_bf16_check.py
}

stage_wheels_report() {
    # Every installed distribution with its wheel tag; the platform wheels are the aarch64 ones.
    "$0" --in-root /opt/lorad/venv/bin/python -c '
import importlib.metadata as md
for d in sorted(md.distributions(), key=lambda d: d.metadata["Name"].lower()):
    wheel = d.read_text("WHEEL") or ""
    tags = [x.split(":", 1)[1].strip() for x in wheel.splitlines() if x.startswith("Tag:")]
    name = d.metadata["Name"]
    print(name + "==" + d.version, tags[0] if tags else "?")
'
}

# --- driver ---

# One row per stage: name, time limit (seconds), and whether a failure stops the run.
STAGES=(
    "host 600 stop"
    "root 1200 stop"
    "wheel 300 stop"
    "install 3600 stop"
    "services 60 stop"
    "model 300 stop"
    "e2e 900 go"
    "bf16 300 go"
    "wheels_report 120 go"
)

main() {
    local passed=0 failed=0 times=()
    log="$(mktemp)"
    trap 'rm -f "$log"; restore_binfmt' EXIT
    local run_start
    run_start=$(date +%s)
    for row in "${STAGES[@]}"; do
        read -r name limit policy <<< "$row"
        say "stage $name (limit ${limit}s)"
        local t0 rc
        t0=$(date +%s)
        set +e
        timeout --kill-after=15 "$limit" "$0" --stage "$name" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
        set -e
        times+=("$name=$(($(date +%s) - t0))s")
        # Stages that check behaviour print PASS/FAIL lines; every other stage counts as one check itself.
        local p f
        p=$(grep -c '^PASS ' "$log" || true)
        f=$(grep -c '^FAIL ' "$log" || true)
        if [ "$p" -eq 0 ] && [ "$f" -eq 0 ]; then
            if [ "$rc" -eq 0 ]; then p=1; else f=1; fi
        elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
            f=1
        fi
        [ "$rc" -eq 124 ] && say "stage $name timed out after ${limit}s"
        passed=$((passed + p))
        failed=$((failed + f))
        if [ "$rc" -ne 0 ] && [ "$policy" = stop ]; then
            say "stage $name failed (exit $rc); stopping"
            break
        fi
    done
    say "stage wall times: ${times[*]} total=$(($(date +%s) - run_start))s"
    echo "test-arm64: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}

case "${1:-}" in
    --stage)
        "stage_$2"
        ;;
    --in-root)
        shift
        in_root "$@"
        ;;
    --enter)
        shift
        enter "$@"
        ;;
    "")
        main
        ;;
    *)
        die "usage: $0 (no arguments)"
        ;;
esac

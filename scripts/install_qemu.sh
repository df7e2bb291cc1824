#!/usr/bin/env bash
# QEMU user emulation of arm64 (aarch64) on an x86-64 Debian machine, registered with the
# kernel's binfmt_misc with the F (fix-binary) flag, so that BuildKit can run the linux/arm64
# build's RUN steps, `docker run --platform linux/arm64` works, and debootstrap can finish an
# arm64 root in a chroot. How CI builds the arm64 image with it: docs/image.md, "The arm64
# image on an x86-64 host (DGX Spark)". As root; idempotent: what is there already is kept.
#
#   scripts/install_qemu.sh            install qemu-user-static + binfmt-support when missing,
#                                      mount binfmt_misc, register qemu-aarch64, then check
#   scripts/install_qemu.sh --check    change nothing; only check
#
# The check, which both end with: binfmt_misc is mounted; the qemu-aarch64 entry is enabled,
# its flags include F and its interpreter exists; and a 132-byte static aarch64 program
# written here (exit(42), three instructions) exits 42 when started in an empty chroot. Only
# the F flag makes that work (the kernel opened the interpreter at registration; the chroot
# has none), as it must inside a container or debootstrap's chroot.
# An entry registered without F (e.g. by qemu-user-binfmt) is not replaced: the message says how.
# On an aarch64 machine nothing is needed or done.
#
# Exit 0 ready, 1 not ready (the message says what is missing and what to do), 2 usage.
# BINFMT_MISC (default /proc/sys/fs/binfmt_misc) is for the tests: a fake directory.
set -euo pipefail

log() { echo "install_qemu: $*" >&2; }
fail() { log "NOT READY: $*"; exit 1; }

check_only=""
case "${1:-}" in
    "") ;;
    --check) check_only=1 ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

binfmt="${BINFMT_MISC:-/proc/sys/fs/binfmt_misc}"
entry="$binfmt/qemu-aarch64"
packages=(qemu-user-static binfmt-support)

if [[ "$(uname -m)" == "aarch64" ]]; then
    log "this machine is aarch64: arm64 runs natively, no emulation needed"
    exit 0
fi

install() {
    [[ "$(id -u)" == 0 ]] || fail "run as root (it installs packages and registers with the kernel)"
    local missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if (( ${#missing[@]} )); then
        log "installing ${missing[*]}"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    else
        log "${packages[*]} already installed"
    fi
    if [[ ! -e "$binfmt/register" ]]; then
        log "mounting binfmt_misc on $binfmt"
        mount -t binfmt_misc binfmt_misc "$binfmt" || fail "cannot mount binfmt_misc on $binfmt" \
            "(a container without privileges? the host must mount it and register qemu-aarch64)"
    fi
    if [[ -e "$entry" ]]; then
        log "qemu-aarch64 already registered"
    else
        # The package registers its formats itself, except where its postinst thinks it runs
        # in a container, or binfmt_misc was not mounted then: import and enable by hand.
        update-binfmts --display qemu-aarch64 >/dev/null 2>&1 || update-binfmts --import qemu-aarch64
        log "registering qemu-aarch64 (update-binfmts --enable)"
        update-binfmts --enable qemu-aarch64 || fail "update-binfmts --enable qemu-aarch64 failed"
    fi
}

check() {
    [[ -e "$binfmt/register" ]] || fail "binfmt_misc is not mounted on $binfmt;" \
        "as root: mount -t binfmt_misc binfmt_misc $binfmt (or run $0 without --check)"
    [[ -e "$entry" ]] || fail "no qemu-aarch64 entry in $binfmt: arm64 programs cannot run here;" \
        "as root: $0 (installs ${packages[*]} and registers it)"
    local state interpreter flags
    state="$(head -n1 "$entry")"
    interpreter="$(sed -n 's/^interpreter //p' "$entry")"
    flags="$(sed -n 's/^flags: //p' "$entry")"
    [[ "$state" == "enabled" ]] || fail "$entry is '$state'; as root: update-binfmts --enable qemu-aarch64" \
        "(or echo 1 > $entry)"
    [[ "$flags" == *F* ]] || fail "qemu-aarch64 is registered with flags '$flags', without F (fix-binary):" \
        "its interpreter $interpreter would be looked up inside each container or chroot, where it is" \
        "not. Replace the entry: as root, echo -1 > $entry; then $0 (qemu-user-static registers with F)"
    [[ -x "$interpreter" ]] || fail "the qemu-aarch64 interpreter $interpreter does not exist;" \
        "as root: apt-get install --reinstall qemu-user-static"
    local root
    root="$(mktemp -d /tmp/dsa-image-qemu-probe.XXXXXX)"
    # shellcheck disable=SC2064  # expand now: the directory made above
    trap "rm -rf '$root'" EXIT
    python3 - "$root/probe" <<'EOF'
import struct, sys
# mov x0, #42; mov x8, #93 (exit); svc #0
code = struct.pack("<3I", 0xD2800540, 0xD2800BA8, 0xD4000001)
base, start = 0x400000, 64 + 56
size = start + len(code)
elf = (b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # 64-bit, little-endian, SysV
       + struct.pack("<HHIQQQIHHHHHH", 2, 0xB7, 1, base + start, 64, 0, 0, 64, 56, 1, 0, 0, 0)  # EXEC, AArch64
       + struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000))  # one PT_LOAD, R+X
with open(sys.argv[1], "wb") as out:
    out.write(elf + code)
EOF
    chmod 755 "$root/probe"
    [[ "$(id -u)" == 0 ]] || fail "the last check (an aarch64 program in a chroot) needs root"
    local code=0 why
    why="$(chroot "$root" /probe 2>&1)" || code=$?
    [[ "$code" == 42 ]] || fail "an aarch64 program in an empty chroot exited $code, not 42" \
        "(${why:-no message}): the qemu-aarch64 entry ($entry: flags '$flags', interpreter" \
        "$interpreter) does not run arm64 programs"
    log "ready: qemu-aarch64 enabled, flags $flags (F: fix-binary), interpreter $interpreter" \
        "($("$(readlink -f "$interpreter")" --version | head -n1)); an aarch64 program ran in an empty chroot (exit 42)"
}

[[ -n "$check_only" ]] || install
check

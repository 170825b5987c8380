#!/usr/bin/env bash
# The wheel on an older system than the one it was built on: a Debian root made with debootstrap
# (bullseye: glibc 2.31, Python 3.9 by default), the wheel installed there with that system's
# Python and pip, a store ingested and read back whole through the loader, and `granary verify`.
# Needs root (debootstrap, chroot) and Debian's mirror. Usage:
#   scripts/check-older-system.sh WHEEL [ROOT_DIR] [SUITE]
set -euo pipefail

wheel=$(realpath "$1")
root=${2:-${TMPDIR:-/tmp}/granary-older-system}
suite=${3:-bullseye}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" != 0 ]; then
    echo "check-older-system: needs root (debootstrap and chroot)" >&2
    exit 2
fi
command -v debootstrap > /dev/null || apt-get install -y -q debootstrap > /dev/null
if [ ! -x "$root/usr/bin/python3" ]; then
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$suite" "$root" "$mirror" > "$root.debootstrap.log" 2>&1 ||
        { tail -20 "$root.debootstrap.log"; exit 1; }
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# This machine's trust store and pip settings (a proxy's CA, say), as the older system's admin
# would have set its own.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
if [ -f /etc/pip.conf ]; then cp /etc/pip.conf "$root/etc/pip.conf"; fi
mounted=()
cleanup() {
    for m in "${mounted[@]}"; do umount "$m" 2> /dev/null || true; done
}
trap cleanup EXIT
for fs in proc sys dev; do
    mountpoint -q "$root/$fs" || { mount --bind "/$fs" "$root/$fs"; mounted+=("$root/$fs"); }
done
mkdir -p "$root/check"
rm -f "$root"/check/*.whl
cp "$wheel" "$root/check/"
cat > "$root/check/check.py" << 'EOF'
import os, platform, subprocess, sys, tempfile
import numpy as np
import granary

print("glibc", platform.libc_ver()[1], "python", platform.python_version(), "granary", granary.__file__)
work = tempfile.mkdtemp()
store = granary.Store(os.path.join(work, "store"), create=True)
rng = np.random.default_rng(0)
records = [rng.integers(0, 65535, 257, dtype=np.uint16) for _ in range(3000)]
store.ingest("tokens", records, dtype="uint16", shape=[257], shard_bytes=256 << 10)
loader = store.loader("tokens", batch_size=64, seed=1, output="numpy", with_indices=True, device="cpu")
seen = 0
for indices, batch in loader:
    for i, row in zip(indices.tolist(), batch):
        assert np.array_equal(row, records[i]), f"record {i}"
        seen += 1
assert seen == len(records), seen
print("loader epoch:", seen, "records equal to the input;", loader.metrics()["blocks_verified"], "blocks verified")
verify = subprocess.run([os.path.join(os.path.dirname(sys.executable), "granary"), "--root",
                         os.path.join(work, "store"), "verify"], capture_output=True, text=True)
print(verify.stdout.strip())
assert verify.returncode == 0, verify.stderr
print("older system: ok")
EOF
chroot "$root" /bin/bash -c '
    set -e
    test -x /venv/bin/pip || python3 -m venv /venv
    /venv/bin/pip install -q --upgrade "pip>=20.3" > /dev/null
    /venv/bin/pip install -q --force-reinstall /check/granary-*.whl numpy
    /venv/bin/python /check/check.py
'

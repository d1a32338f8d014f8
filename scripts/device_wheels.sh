#!/usr/bin/env bash
# Download, here, the wheels that the GPU machine lacks for running a swarm (hivemind with its p2pd,
# what hivemind imports that the machine's image does not hold, and the transformers release that
# setup.cfg requires: the image's is older), for its Python 3.12 on x86-64, into .whl/ (ignored by
# git; `run` carries it with carry=[".whl"]). scripts/device_check.sh installs them there and runs
# the swarm stage only if they are present. About 34 MiB, of the 64 MiB that a run carries.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
wheels=(
    transformers==5.24.0 hivemind==1.1.12 base58==2.1.1 configargparse==1.9.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
    netaddr==1.3.0 py-cid==0.5.0 py-multihash==3.0.0 py-multibase==2.0.0 py-multicodec==1.0.0 morphys==1.0
    blake3==1.0.11 mmh3==5.3.1 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing_extensions==4.16.0
)
# published without wheels: built here (pure Python)
pure_python_sources=(prefetch_generator==1.0.3 varint==1.0.2 python-baseconv==1.2.2)
platforms=()
for tag in manylinux_2_34 manylinux_2_28 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${wheels[@]}"
python3 -m pip wheel -q --no-deps -w .whl "${pure_python_sources[@]}"
du -sh .whl

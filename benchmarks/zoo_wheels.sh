#!/usr/bin/env bash
# The wheels a GPU machine needs for benchmarks/zoo.py, in .whl/ (git-ignored): egglog and
# what it imports (../shared/tools/device-wheels.sh), with egglog's shared library stripped
# of its debug information (48.6 MB -> 6.2 MB: the wheels and the tree must travel in
# 64 MiB), and transformers at the dev extra's pin (the GPU machine has 5.17), so that the
# GPU runs the graphs CI tests.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
bash ../shared/tools/device-wheels.sh
pin=$(grep -o 'transformers==[0-9.]*' pyproject.toml)
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "$pin"
wheel=$(ls .whl/egglog-*.whl)
work=$(mktemp -d)
(cd "$work" && python3 -m zipfile -e "$root/$wheel" . && strip --strip-debug egglog/*.so && rm -f "$root/$wheel" &&
 python3 -m zipfile -c "$root/$wheel" ./*)
rm -rf "$work"
du -sh .whl
